"""What a first run of the commands meets, each as a real subprocess: an expected failure is one
line on stderr naming the problem and the fix with exit code 2, Ctrl-C is one line with exit
code 130, and no traceback ever reaches the terminal. Also the seed a run without --seed draws,
--version and --help, the JSON-only stdout of build-engine, and other sinks' deltas."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from llm_stage_client import Client
from talker_reference import talker_binary

ROOT = Path(__file__).resolve().parents[2]
# This checkout's code, whatever the installed console scripts point at.
ENV = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "clients" / "python"), str(ROOT)])}
RUNNER = [sys.executable, "-m", "llm_runner_svc"]
STAGE = [sys.executable, "-m", "llm_stage_client.cli"]
TOPOLOGIES = ROOT / "services" / "orchestrator" / "topologies"
LONG = 120.0  # generous: the machine may be loaded; nothing below waits this long when it works


def run(*cmd: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LONG, env=ENV, cwd=ROOT,
                          stdin=stdin)


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The single stderr line of a failed command, checked for its exit code and words."""
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def start_up(*args: str, env: dict[str, str] | None = None
             ) -> tuple[subprocess.Popen, list[str]]:
    """`llm-runner up ARGS` until the orchestrator listens: the process and its stdout lines."""
    proc = subprocess.Popen([*RUNNER, "up", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV | (env or {}), cwd=ROOT)
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or "orchestrator listening" not in lines[-1]:
        line = proc.stdout.readline()
        assert line, f"llm-runner up ended: {proc.wait(LONG)} {proc.stderr.read()}"  # type: ignore[union-attr]
        lines.append(line)
    return proc, lines


def stop_up(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # a served deployment stops cleanly on Ctrl-C: exit 0
    assert proc.wait(LONG) == 0
    assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


def endpoint(lines: list[str], pattern: str) -> str:
    found = [m.group(1) for line in lines if (m := re.search(pattern, line))]
    assert found, lines
    return found[0]


@pytest.fixture(scope="module")
def deployment() -> Iterator[SimpleNamespace]:
    """One backbone stage and the orchestrator, as `llm-runner up` starts them; requests whose
    id starts with "slow" take 200 ms a step."""
    proc, lines = start_up(env={"LLM_RUNNER_FAULTS": json.dumps(
        {"step_delay_ms": 200, "slow_prefix": "slow"})})
    target = endpoint(lines, r"orchestrator listening on ([\d.]+:\d+)")
    yield SimpleNamespace(target=target, port=target.rsplit(":", 1)[1],
                          stage=endpoint(lines, r"stage process \d+ on ([\d.]+:\d+)"))
    stop_up(proc)


def full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is already full: a process writing to it blocks at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w


def _sigint_default() -> None:
    # A shell runs background jobs with SIGINT ignored, and an ignored signal stays ignored
    # across exec; the command must see SIGINT as a terminal's Ctrl-C delivers it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def blocked_writer(cmd: list[str]) -> tuple[subprocess.Popen, int]:
    """Runs `cmd` with stdout on a full pipe until it is blocked writing its output (so it is
    inside the work, past start-up); the process and the pipe's read end."""
    r, w = full_pipe()
    proc = subprocess.Popen(cmd, stdout=w, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT, preexec_fn=_sigint_default)
    os.close(w)
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + LONG
    while "pipe_write" not in wchan.read_text():
        assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the command never wrote its output"
        time.sleep(0.02)  # polling /proc, not synchronising: the condition decides
    return proc, r


def interrupt_when_writing(cmd: list[str]) -> tuple[int, str]:
    """SIGINT to `cmd` while it writes its output; its exit code and stderr."""
    proc, r = blocked_writer(cmd)
    proc.send_signal(signal.SIGINT)
    with os.fdopen(r, "rb") as out:
        out.read()  # let it finish its last writes
    return proc.wait(LONG), proc.stderr.read()  # type: ignore[union-attr]


def test_serve_on_a_busy_port(deployment: SimpleNamespace) -> None:
    res = run(*RUNNER, "serve", "--port", deployment.port)
    one_line(res, 2, f"cannot listen on 127.0.0.1:{deployment.port}", "--port")


def test_up_on_a_busy_port_fails_before_starting_stages(deployment: SimpleNamespace) -> None:
    for cmd in (RUNNER, STAGE):  # `llm-stage up` is the same command
        res = run(*cmd, "up", "--port", deployment.port)
        one_line(res, 2, f"cannot listen on 127.0.0.1:{deployment.port}", "--port")
        assert "stage process" not in res.stdout


def test_up_before_the_talker_is_built(tmp_path: Path) -> None:
    shutil.copy(TOPOLOGIES / "thinker.json", tmp_path)
    topology = json.loads((TOPOLOGIES / "speaking.json").read_text())
    topology["stages"][1]["launch"]["command"][0] = "build/talker_stage"  # not there
    (tmp_path / "speaking.json").write_text(json.dumps(topology))
    res = run(*RUNNER, "up", "--port", "0", "--topology", str(tmp_path / "speaking.json"))
    one_line(res, 2, "FAILED_PRECONDITION", "talker_stage does not exist",
             "cmake -S clients/cpp -B clients/cpp/build")


def test_generate_with_nothing_listening() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run(*STAGE, "generate", "--target", f"127.0.0.1:{port}", "Hi")
    one_line(res, 2, "UNAVAILABLE", f"nothing answers at 127.0.0.1:{port}", "llm-stage up")
    assert res.stdout == ""
    res = run(*STAGE, "generate", "--target", "no-such-host.invalid:50050", "Hi")
    one_line(res, 2, "UNAVAILABLE", "cannot resolve the host", "host:port")


def test_generate_pointed_at_a_stage(deployment: SimpleNamespace) -> None:
    res = run(*STAGE, "generate", "--target", deployment.stage, "Hi")
    one_line(res, 2, "UNIMPLEMENTED", "is not an orchestrator", "orchestrator listening on")


def test_a_prompt_too_long_echoes_nothing() -> None:
    res = run(*RUNNER, "generate", "--max-seq", "16", "Once upon a time " * 8)
    one_line(res, 2, "INVALID_ARGUMENT", "maxSeq is 16")
    assert res.stdout == ""


def test_ctrl_c_during_llm_runner_generate() -> None:
    code, err = interrupt_when_writing([*RUNNER, "generate", "Once upon a time"])
    assert "Traceback" not in err and code == 130, err
    assert err == "llm-runner: interrupted\n"


def test_ctrl_c_during_llm_stage_generate(deployment: SimpleNamespace) -> None:
    proc = subprocess.Popen([*STAGE, "generate", "--target", deployment.target, "--request-id",
                             "slow-interrupted", "Once upon a time"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            preexec_fn=_sigint_default)
    assert proc.stdout is not None and proc.stdout.read(1)  # streaming; the next step is slow
    proc.send_signal(signal.SIGINT)  # lands while the client waits on the stream
    _, err = proc.communicate(timeout=LONG)
    code = proc.returncode
    assert "Traceback" not in err and code == 130, err
    assert err == "llm-stage: interrupted\n"
    wait_idle(deployment.target)  # the request ended everywhere


def test_llm_stage_stdout_reader_going_away(deployment: SimpleNamespace) -> None:
    proc = subprocess.Popen([*STAGE, "generate", "--target", deployment.target, "--request-id",
                             "slow-piped", "Once upon a time"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.read(1)  # streaming; the next step is slow
    proc.stdout.close()  # `| head -c 1`
    assert proc.wait(LONG) == 141
    assert proc.stderr is not None and proc.stderr.read() == b""
    wait_idle(deployment.target)


def wait_idle(target: str) -> None:
    """Until the orchestrator at `target` runs and queues no request."""
    with Client(target, timeout=30) as client:
        deadline = time.monotonic() + LONG
        while (topo := client.topology())["running"] or topo["queued"]:
            assert time.monotonic() < deadline, topo
            time.sleep(0.05)


def test_stdout_reader_going_away() -> None:
    """`llm-runner generate | head -c 5`: exit 141 as coreutils do, and nothing on stderr."""
    proc, r = blocked_writer([*RUNNER, "generate", "Once upon a time"])
    os.close(r)  # the reader leaves while the command writes
    assert proc.wait(LONG) == 141
    assert proc.stderr is not None and proc.stderr.read() == ""


def test_ctrl_c_while_up_starts_its_stages(tmp_path: Path) -> None:
    (tmp_path / "stage.json").write_text(json.dumps({"stages": [{
        "id": "backbone", "runner": "llm.backbone", "artifact": "smollm2",  # seconds to load
        "emits": ["text", "tokens"]}]}))
    (tmp_path / "topology.json").write_text(json.dumps({
        "stages": [{"id": "backbone", "runner": "llm.backbone", "emits": ["text", "tokens"],
                    "inputs": ["request:prompt"], "launch": {"config": "stage.json"}}],
        "sinks": ["backbone:text"]}))
    proc = subprocess.Popen([*RUNNER, "up", "--port", "0", "--topology",
                             str(tmp_path / "topology.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True, preexec_fn=_sigint_default)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + LONG

    def is_loading() -> bool:  # the stage process runs our code (numpy is mapped): past the
        # interpreter's own start-up, which a SIGINT would abort with Python's fatal error
        pids = children.read_text().split()
        return bool(pids) and "numpy" in Path(f"/proc/{pids[0]}/maps").read_text()

    while not is_loading():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)  # polling /proc, not synchronising: the condition decides
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: parent and child alike
    out, err = proc.communicate(timeout=LONG)
    assert "Traceback" not in err, err
    if "orchestrator listening" in out:  # the load beat us: a served deployment stops cleanly
        assert proc.returncode == 0
    else:  # one line, from `up` alone (the stage child does not repeat it), after the stage's
        # line naming what it loads where it got that far
        lines = [line for line in err.splitlines() if not line.startswith("loading SmolLM2")]
        assert (proc.returncode, lines) == (130, ["llm-runner: interrupted"])


def test_without_seed_each_run_draws_one_and_reports_it() -> None:
    def sample(*seed: str) -> tuple[str, int]:
        res = run(*RUNNER, "generate", "--max-tokens", "24", *seed, "Once upon a time")
        assert res.returncode == 0, res.stderr
        m = re.search(r"\bseed=(\d+)", res.stderr)
        assert m, res.stderr
        return res.stdout, int(m.group(1))

    (text_a, seed_a), (_, seed_b) = sample(), sample()
    assert seed_a != seed_b  # two draws of 32 random bits
    assert sample("--seed", str(seed_a)) == (text_a, seed_a)  # the reported seed repeats it


def test_version_and_help() -> None:
    runner = run(*RUNNER, "--version")
    assert runner.returncode == 0
    assert re.fullmatch(r"llm-runner \S+ \(contract llmstage\.v1; engines: numpy.*\)\n",
                        runner.stdout), runner.stdout
    client = run(*STAGE, "--version")
    assert client.returncode == 0 and "contract llmstage.v1" in client.stdout, client.stdout
    gen = " ".join(run(*RUNNER, "generate", "--help").stdout.split())  # unwrapped
    for words in ("stories260K", "smollm2", "(default: 1.0)", "(default: 0.8)", "(default: 50)",
                  "fresh random seed", "(default: numpy)"):
        assert words in gen, words
    assert "(default: fp16)" in " ".join(run(*RUNNER, "build-engine", "--help").stdout.split())
    assert "(default: 127.0.0.1)" in " ".join(run(*RUNNER, "serve", "--help").stdout.split())
    assert "--sinks" in run(*STAGE, "generate", "--help").stdout


def test_build_engine_prints_only_json_on_stdout(tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx", reason="the tensorrt extra")
    res = run(*RUNNER, "build-engine", "--out", str(tmp_path), "--targets", "sm80")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert json.loads(res.stdout)["targets"] == ["sm80"]  # the whole of stdout is the report
    phases = re.findall(r"build-engine \[\s*[\d.]+ s\] (\w+)", res.stderr)
    assert phases == ["load", "export", "parse", "done"], res.stderr


def test_report_counts_are_integers(deployment: SimpleNamespace) -> None:
    res = run(*STAGE, "generate", "--target", deployment.target, "--max-tokens", "6",
              "Once upon a time")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stderr.strip().splitlines()[-1])
    diag = report["diagnostics"]["backbone"]
    assert diag["tokens_out"] == 6 and isinstance(diag["tokens_out"], int)
    assert isinstance(diag["decode_steps"], int)
    assert isinstance(diag["sampling"]["seed"], int)  # drawn by the stage, reported
    assert isinstance(diag["sampling"]["temperature"], float)  # a setting, not a count


def test_speaking_topology_audio_is_visible() -> None:
    talker_binary()  # built once (cmake) if missing
    proc, lines = start_up("--topology", str(TOPOLOGIES / "speaking.json"))
    try:
        target = endpoint(lines, r"orchestrator listening on ([\d.]+:\d+)")
        res = run(*STAGE, "generate", "--target", target, "--max-tokens", "8",
                  "--sinks", "thinker:text,talker:audio", "Once upon a time")
    finally:
        stop_up(proc)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()  # the thinker's text
    lines = res.stderr.strip().splitlines()
    frames = [int(m.group(1)) for line in lines[:-1]
              if (m := re.match(r"\[talker:audio\] \+(\d+) frames? \(\d+ so far\): codes", line))]
    assert sum(frames) == 8, lines
    assert json.loads(lines[-1])["diagnostics"]["talker"]["frames"] == 8
