"""The stage's deployment file (multistage_config.json style), validated at load.

    {"stages": [{"id": "thinker", "runner": "llm.backbone", "artifact": "stories260K",
                 "engine": "numpy", "emits": ["text", "tokens"], "inputs": ["request:text"],
                 "maxBatch": 8, "maxSeq": 512,
                 "config": {"temperature": 0.7, "accept_hidden_layer": -1}}]}

`artifact` is a model path (relative to the file) or a built-in name ("stories260K",
"smollm2"); `config.checkpoint` is taken relative to it. Unknown keys, bad values, and keys this
build cannot honour yet fail at load, naming the key and the rule; the LlmRunner keys under
`config`, down to every sub-key, are checked by the table in `runner_keys`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llm_runner_svc.engines import engine_names
from llm_runner_svc.engines.synthetic_engine import DEFAULT_STEP_MS, DEFAULT_TOKEN_US
from llm_runner_svc.errors import NotFound, RunnerError, Unimplemented
from llm_runner_svc.export.sidecar import is_build_dir, load_sidecar
from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.sampling import SamplingDefaults
from llm_runner_svc.runtime.speculative import SpecConfig
from llm_runner_svc.stage.limits import KEYS as LIMIT_KEYS
from llm_runner_svc.stage.limits import RequestLimits, parse_limits
from llm_runner_svc.stage.runner_keys import ConfigError, check_runner_keys
from llm_runner_svc.stage.visual_pruning import PruningConfig

RUNNER = "llm.backbone"
_BUILTIN = ("stories260K", "smollm2")
_SYNTHETIC_KEYS = ("syntheticStepMs", "syntheticTokenUs")  # the synthetic engine's step time
_STAGE_KEYS = {"id", "runner", "artifact", "engine", "emits", "inputs", "maxBatch", "maxSeq",
               "config", "ports", "maxQueued", "maxTokensInFlight", "device",
               "creditIdleTimeoutS", "maxTokensPerStep", "kvMemoryBytes",
               "kvMemoryFraction", "maxLoras", "maxLoraRank", *LIMIT_KEYS,
               *_SYNTHETIC_KEYS}
_PORT_KEYS = {"policy", "buffer", "shmRingBytes", "maxShmSubscriptions", "maxShmBytes"}
_INPUTS = ("request:text", "request:messages", "request:token_ids")
_EMITS = ("text", "tokens", "hidden")
_GRAPH_PLAN_ENGINE = "tensorrt"  # the engine that serves build-engine directories and caches
_SYNTHETIC = "synthetic"  # the engine of benchmarks and load tests: picks at a set step time


@dataclass(frozen=True)
class StageConfig:
    """One stage of the deployment; every field has the value used when no file is given."""

    stage_id: str = "backbone"
    artifact: str = "stories260K"
    engine: str = "numpy"
    emits: tuple[str, ...] = ("text", "tokens")
    inputs: tuple[str, ...] = _INPUTS
    max_batch: int = 8
    max_seq: int = 0  # 0 = min(model context, 2048)
    accept_hidden_layer: int = -1
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_waiting: int = 256
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may carry
    hidden_policy: str = "block"  # a full subscriber buffer: "block" the producer or "disconnect"
    hidden_buffer: int = 64  # messages per subscriber
    shm_ring_bytes: int = 0  # shared-memory ring per subscriber; 0 = sized from the width
    max_shm_subscriptions: int = 8  # shared-memory subscriptions open at once on the stage
    max_shm_bytes: int = 256 << 20  # their rings' bytes in total
    max_queued: int = 0  # admitted requests not yet decoding, beyond which Admit refuses (0 = off)
    max_tokens_in_flight: int = 0  # sum of prompt + max new tokens of unended runs (0 = off)
    credit_idle_timeout_s: float = 60.0  # a Step stream out of credit this long is ended
    max_tokens_per_step: int = 0  # decode rows + prefill chunks per step (0 = engine default)
    kv_memory_bytes: int = 0  # KV pool on the host (0 = maxBatch requests of maxSeq)
    kv_memory_fraction: float = 0.0  # KV pool on a GPU: share of free memory (0 = by bytes)
    prefix_cache: bool = False  # config.context_cache.enable_reuse
    prefix_cache_records: int = 0  # config.context_cache.max_records (0 = the pool bounds)
    prefix_cache_snapshots: int = 0  # config.context_cache.max_snapshots (0 = no states kept)
    spec: SpecConfig | None = None  # config.spec_decode (method ngram); None = plain decode
    lora_adapters: tuple[tuple[str, str], ...] = ()  # config.lora_adapters: (name, directory);
    # a request's `lora` k-th name runs on the engine's adapter k + 1
    max_loras: int = 0  # maxLoras: adapter slots (resident at once); 0 = len(lora_adapters)
    max_lora_rank: int = 0  # maxLoraRank: largest rank a slot holds (0 = the engine's default)
    adapter_root: str = ""  # where LoadAdapter's relative paths start (the artifact's folder)
    adapter_root_is: str = ""  # what adapter_root is, for errors ("the artifact's folder")
    source: str = ""  # where the stage was read ("stage.json: stages[0]"); "" = not a file

    multimodal_artifact: str = ""  # config.multimodal_artifact: the vision tower's directory
    # ("" = the artifact's own, when it is a vision-language model)
    encoder_cache_bytes: int = 0  # config.context_cache.encoder_cache_budget_bytes (0 = off)
    visual_pruning: PruningConfig | None = None  # config.visual_pruning; None = every token
    engine_dir: str = ""  # a build-engine directory the engine loads its plan from
    runtime_cache: str = ""  # the tensorrt engine's runtime cache file (read at start, saved)
    device: str = ""  # the torch engine's device ("cpu", "cuda", "cuda:N"); "" = GPU if any
    synthetic_step_ms: float = DEFAULT_STEP_MS  # the synthetic engine's time per step
    synthetic_token_us: float = DEFAULT_TOKEN_US  # and per token of a step's batch

    def where(self, key: str) -> str:
        """`key` as errors name it: after the stage's place in its file, as the file's own
        checks do (`stage.json: stages[0].config.visual_pruning`)."""
        return f"{self.source}.{key}" if self.source else key

    def runtime_config(self) -> RuntimeConfig:
        """The runtime's settings for this stage."""
        return RuntimeConfig(
            max_batch=self.max_batch, max_seq=self.max_seq, max_waiting=self.max_waiting,
            hidden_layer=self.accept_hidden_layer if self.has_hidden_port else None,
            sampling=self.sampling, max_tokens_per_step=self.max_tokens_per_step,
            kv_memory_bytes=self.kv_memory_bytes, kv_memory_fraction=self.kv_memory_fraction,
            prefix_cache=self.prefix_cache, prefix_cache_records=self.prefix_cache_records,
            prefix_cache_snapshots=self.prefix_cache_snapshots, spec=self.spec)

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for create_engine beyond the model (none for most engines)."""
        opts: dict[str, Any] = {"build_dir": self.engine_dir,
                                "runtime_cache": self.runtime_cache, "device": self.device}
        out = {k: v for k, v in opts.items() if v}
        if self.engine == _SYNTHETIC:  # passed even at 0, which is a valid step time
            out.update(step_ms=self.synthetic_step_ms, token_us=self.synthetic_token_us)
        return out


    @property
    def num_lora_slots(self) -> int:
        """Adapters resident at once: maxLoras, else as many as config.lora_adapters."""
        return self.max_loras or len(self.lora_adapters)

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise ConfigError(f"maxBatch must be positive, got {self.max_batch}")
        if self.max_seq < 0:
            raise ConfigError(f"maxSeq must be >= 0, got {self.max_seq}")
        if self.hidden_policy not in ("block", "disconnect"):
            raise ConfigError(f"ports.hidden.policy: 'block' or 'disconnect', got "
                              f"{self.hidden_policy!r}")
        if self.hidden_buffer <= 0 or 0 < self.shm_ring_bytes < 4096:
            raise ConfigError("ports.hidden: buffer must be positive and shmRingBytes 0 (sized "
                              "from the port's width) or >= 4096")
        if self.max_shm_subscriptions < 0 or self.max_shm_bytes < 0:
            raise ConfigError(f"ports.hidden: maxShmSubscriptions and maxShmBytes must be >= 0 "
                              f"(0 = no shared memory), got {self.max_shm_subscriptions} and "
                              f"{self.max_shm_bytes}")
        if self.max_queued < 0 or self.max_tokens_in_flight < 0:
            raise ConfigError(f"maxQueued and maxTokensInFlight must be >= 0 (0 = no limit), "
                              f"got {self.max_queued} and {self.max_tokens_in_flight}")
        if not self.credit_idle_timeout_s > 0:
            raise ConfigError(f"creditIdleTimeoutS must be a number of seconds > 0, got "
                              f"{self.credit_idle_timeout_s}")
        if self.max_tokens_per_step < 0 or self.kv_memory_bytes < 0 \
                or not 0.0 <= self.kv_memory_fraction < 1.0:
            raise ConfigError(f"maxTokensPerStep and kvMemoryBytes must be >= 0 and "
                              f"kvMemoryFraction in [0, 1), got {self.max_tokens_per_step}, "
                              f"{self.kv_memory_bytes} and {self.kv_memory_fraction}")
        if self.spec is not None and self.has_hidden_port:
            raise ConfigError("config.spec_decode: a speculative build emits no hidden port; "
                              "drop 'hidden' from emits or spec_decode")
        if self.engine not in engine_names():
            raise ConfigError(f"engine {self.engine!r} is unknown; valid: {engine_names()}")
        if self.max_loras < 0 or self.max_lora_rank < 0:
            raise ConfigError(f"maxLoras and maxLoraRank must be >= 0, got {self.max_loras} "
                              f"and {self.max_lora_rank}")
        if self.max_loras and self.max_loras < len(self.lora_adapters):
            raise ConfigError(f"maxLoras {self.max_loras} is below the "
                              f"{len(self.lora_adapters)} adapters of config.lora_adapters")
        if self.num_lora_slots and self.engine not in ("numpy", "torch"):
            raise ConfigError(f"config.lora_adapters / maxLoras: the {self.engine!r} engine "
                              "serves no LoRA adapters (the 'numpy' and 'torch' engines do)")
        if self.device and self.engine != "torch":
            raise ConfigError(f"device: only the 'torch' engine takes one, this stage's engine "
                              f"is {self.engine!r}")
        if self.device and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device: 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._check_synthetic()

    def _check_synthetic(self) -> None:
        for key, value, unit in (("syntheticStepMs", self.synthetic_step_ms, "milliseconds"),
                                 ("syntheticTokenUs", self.synthetic_token_us, "microseconds")):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{key}: must be a finite number of {unit} >= 0, got "
                                  f"{value!r}")
        if self.engine == _SYNTHETIC and self.has_hidden_port:
            raise ConfigError("emits: the 'synthetic' engine computes no hidden states; drop "
                              "'hidden' from emits")

    @property
    def has_hidden_port(self) -> bool:
        return "hidden" in self.emits


def load_stage_config(path: str | Path, stage_id: str | None = None) -> StageConfig:
    """Read `path` and return the stage named `stage_id` (or the only llm.backbone stage)."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"stage config {str(p)!r} does not exist")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or set(doc) != {"stages"} or not isinstance(doc["stages"], list):
        raise ConfigError(f"{p}: the file must be an object with one key, 'stages' (a list)")
    ours = [(i, s) for i, s in enumerate(doc["stages"])
            if isinstance(s, dict) and s.get("runner") == RUNNER]
    if stage_id is not None:
        ours = [(i, s) for i, s in ours if s.get("id") == stage_id]
    if len(ours) != 1:
        which = f"id {stage_id!r} and " if stage_id else ""
        raise ConfigError(f"{p}: expected one stage with {which}runner {RUNNER!r}, found "
                          f"{len(ours)}" + ("" if stage_id else "; pick one with --stage"))
    i, raw = ours[0]
    try:
        config = _parse_stage(raw, p.parent)
    except RunnerError as exc:
        raise type(exc)(f"{p}: stages[{i}].{exc.message}") from exc
    return replace(config, source=f"{p}: stages[{i}]")


def _parse_stage(raw: Mapping[str, Any], base: Path) -> StageConfig:
    unknown = sorted(set(raw) - _STAGE_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key (valid: {sorted(_STAGE_KEYS)})")
    sid = _typed(raw, "id", str, None)
    if not sid:
        raise ConfigError("id: required, a non-empty string")
    artifact = _typed(raw, "artifact", str, "stories260K")
    if artifact not in _BUILTIN and not Path(artifact).is_absolute():
        artifact = str(base / artifact)
    emits = tuple(_str_list(raw, "emits", ["text", "tokens"], _EMITS))
    inputs = tuple(_str_list(raw, "inputs", list(_INPUTS), _INPUTS))
    cfg = _typed(raw, "config", dict, {})
    hidden_layer, sampling, checkpoint = _parse_runner_keys(cfg)
    cache = cfg.get("context_cache", {})
    engine = _typed(raw, "engine", str, "numpy")
    given = [k for k in _SYNTHETIC_KEYS if k in raw]
    if given and engine != _SYNTHETIC:
        raise ConfigError(f"{given[0]}: only the {_SYNTHETIC!r} engine takes it, this "
                          f"stage's engine is {engine!r}")
    engine_dir, runtime_cache = _graph_plan_keys(artifact, engine, cfg)
    if engine_dir:
        artifact = load_sidecar(engine_dir).model
    ports = _typed(raw, "ports", dict, {})
    if set(ports) - {"hidden"}:
        raise ConfigError(f"ports: only 'hidden' takes settings, got {sorted(ports)}")
    hidden = ports.get("hidden", {})
    if not isinstance(hidden, dict):
        raise ConfigError("ports.hidden: must be an object")
    unknown_port_keys = sorted(set(hidden) - _PORT_KEYS)
    if unknown_port_keys:
        raise ConfigError(f"ports.hidden.{unknown_port_keys[0]}: unknown key (valid: "
                          f"{sorted(_PORT_KEYS)})")
    adapter_root, adapter_root_is = _adapter_root(artifact, base)
    adapters = tuple((name, str(adapter_root / path))
                     for name, path in cfg.get("lora_adapters", {}).items())
    multimodal = cfg.get("multimodal_artifact", "")
    if multimodal and not Path(multimodal).is_absolute():
        root = base if artifact in _BUILTIN else Path(artifact)
        multimodal = str((root.parent if root.is_file() else root) / multimodal)
    pruning = cfg.get("visual_pruning")
    if checkpoint:
        artifact = str(Path(artifact) / checkpoint) if artifact not in _BUILTIN else checkpoint
    return StageConfig(
        stage_id=sid, artifact=artifact, engine=engine, engine_dir=engine_dir,
        runtime_cache=runtime_cache,
        emits=emits, inputs=inputs, max_batch=_typed(raw, "maxBatch", int, 8),
        max_seq=_typed(raw, "maxSeq", int, 0), accept_hidden_layer=hidden_layer,
        sampling=sampling, hidden_policy=_typed(hidden, "policy", str, "block", "ports.hidden."),
        hidden_buffer=_typed(hidden, "buffer", int, 64, "ports.hidden."),
        shm_ring_bytes=_typed(hidden, "shmRingBytes", int, 0, "ports.hidden."),
        max_shm_subscriptions=_typed(hidden, "maxShmSubscriptions", int, 8, "ports.hidden."),
        max_shm_bytes=_typed(hidden, "maxShmBytes", int, 256 << 20, "ports.hidden."),
        limits=parse_limits(raw),
        max_queued=_typed(raw, "maxQueued", int, 0),
        max_tokens_in_flight=_typed(raw, "maxTokensInFlight", int, 0),
        credit_idle_timeout_s=float(_typed(raw, "creditIdleTimeoutS", float, 60.0)),
        max_tokens_per_step=_typed(raw, "maxTokensPerStep", int, 0),
        kv_memory_bytes=_typed(raw, "kvMemoryBytes", int, 0),
        kv_memory_fraction=_typed(raw, "kvMemoryFraction", float, 0.0),
        device=_typed(raw, "device", str, ""),
        synthetic_step_ms=float(_typed(raw, "syntheticStepMs", float, DEFAULT_STEP_MS)),
        synthetic_token_us=float(_typed(raw, "syntheticTokenUs", float, DEFAULT_TOKEN_US)),
        prefix_cache=bool(cache.get("enable_reuse", False)),
        prefix_cache_records=cache.get("max_records", 0),
        prefix_cache_snapshots=cache.get("max_snapshots", 0), lora_adapters=adapters,
        multimodal_artifact=multimodal,
        encoder_cache_bytes=cache.get("encoder_cache_budget_bytes", 0),
        visual_pruning=PruningConfig.from_keys(pruning) if pruning is not None else None,
        max_loras=_typed(raw, "maxLoras", int, 0),
        max_lora_rank=_typed(raw, "maxLoraRank", int, 0), adapter_root=str(adapter_root),
        adapter_root_is=adapter_root_is,
        spec=_spec_config(cfg.get("spec_decode"), _draft_path(cfg, artifact, base)))


def _draft_path(cfg: Mapping[str, Any], artifact: str, base: Path) -> str:
    """`draft_checkpoint`, relative to the artifact's folder (the config file's for a
    built-in model); a built-in name stays a name."""
    draft = cfg.get("draft_checkpoint", "")
    if not draft or draft in _BUILTIN or Path(draft).is_absolute():
        return str(draft)
    root = base if artifact in _BUILTIN else Path(artifact)
    return str((root.parent if root.is_file() else root) / draft)


def _spec_config(raw: Mapping[str, Any] | None, draft: str) -> SpecConfig | None:
    """`spec_decode` (a linear chain, checked by runner_keys): method ngram unless a
    `draft_checkpoint` makes it draft. K is proposal_tokens (0: draft_step, else 4), capped
    by dspark_max_proposal_len (0 = no cap); verify_tokens, when given, is K + 1. Proposals
    shorter than dspark_min_proposal_len are not verified; max_verify_tokens (unset: the
    default) bounds a step's verify tokens; min_accepted_per_step and
    acceptance_warmup_steps (unset: the defaults) turn a losing request's speculation off.
    dspark_scheduler "threshold"
    stops a draft's proposal where its top probability falls below
    dspark_confidence_threshold."""
    if raw is None:
        if draft:
            raise ConfigError("config.draft_checkpoint: a draft model needs spec_decode "
                              "(method 'draft')")
        return None
    step = raw.get("draft_step", 0)
    k = raw.get("proposal_tokens", 0) or step or 4
    if step and step != k:
        raise ConfigError(f"config.spec_decode.draft_step: a linear chain drafts "
                          f"proposal_tokens ({k}) steps, got {step}")
    k = min(k, raw.get("dspark_max_proposal_len", 0) or k)
    if raw.get("verify_tokens", k + 1) != k + 1:
        raise ConfigError(f"config.spec_decode.verify_tokens: a linear chain of {k} proposed "
                          f"tokens verifies {k + 1}, got {raw['verify_tokens']}")
    is_threshold = raw.get("dspark_scheduler", "off") == "threshold"
    threshold = raw.get("dspark_confidence_threshold")
    if is_threshold != (threshold is not None):
        raise ConfigError("config.spec_decode.dspark_confidence_threshold: given with, and "
                          "only with, dspark_scheduler 'threshold'")
    try:
        return SpecConfig(raw.get("method", "draft" if draft else "ngram"), k,
                          min_proposal=raw.get("dspark_min_proposal_len", 1),
                          draft_layers=raw.get("draft_layers", 0), draft_checkpoint=draft,
                          confidence_threshold=float(threshold or 0.0),
                          max_batch=raw.get("disable_by_batch_size", 0),
                          max_verify_tokens=raw.get("max_verify_tokens",
                                                    SpecConfig.max_verify_tokens),
                          min_accepted_per_step=float(raw.get(
                              "min_accepted_per_step", SpecConfig.min_accepted_per_step)),
                          acceptance_warmup_steps=raw.get(
                              "acceptance_warmup_steps", SpecConfig.acceptance_warmup_steps))
    except RunnerError as exc:
        raise ConfigError(f"config.{exc.message}") from exc


def _adapter_root(artifact: str, base: Path) -> tuple[Path, str]:
    """Where `lora_adapters` paths (and LoadAdapter's) start: the artifact (its folder when
    it is a file; the config file's folder for a built-in model), and what that is, in
    words for errors."""
    if artifact in _BUILTIN:
        return base, f"the stage file's folder, as the artifact {artifact!r} is built in"
    root = Path(artifact)
    if root.is_file():
        return root.parent, f"the folder of the artifact {root.name}"
    return root, "the artifact"


def _parse_runner_keys(cfg: Mapping[str, Any]) -> tuple[int, SamplingDefaults, str]:
    check_runner_keys(cfg)
    d = SamplingDefaults()
    sampling = SamplingDefaults(
        max_generate_length=cfg.get("max_generate_length", d.max_generate_length),
        temperature=float(cfg.get("temperature", d.temperature)),
        top_p=float(cfg.get("top_p", d.top_p)), top_k=cfg.get("top_k", d.top_k))
    return cfg.get("accept_hidden_layer", -1), sampling, cfg.get("checkpoint", "")


def _graph_plan_keys(artifact: str, engine: str, cfg: Mapping[str, Any]) -> tuple[str, str]:
    """A build-engine directory as `artifact`, and `runtime_cache` (relative to it): only the
    tensorrt engine reads them."""
    engine_dir = artifact if artifact not in _BUILTIN and is_build_dir(artifact) else ""
    cache: str = cfg.get("runtime_cache", "")
    if (engine_dir or cache) and engine != _GRAPH_PLAN_ENGINE:
        what = "config.runtime_cache" if cache else "artifact (a build-engine directory)"
        raise Unimplemented(f"{what}: cannot be honoured: only the {_GRAPH_PLAN_ENGINE!r} "
                            f"engine reads it, this stage's engine is {engine!r}")
    if cache and not Path(cache).is_absolute():
        base = Path(artifact) if Path(artifact).is_dir() else Path(artifact).parent
        cache = str(base / cache)
    return engine_dir, cache


def _typed(raw: Mapping[str, Any], key: str, kind: type, default: Any, prefix: str = "") -> Any:
    """raw[key] if it is a `kind` (float takes any JSON number; bool is no number)."""
    if key not in raw:
        return default
    value = raw[key]
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{prefix}{key}: must be a {kind.__name__}, got {value!r}")
    return value


def _str_list(raw: Mapping[str, Any], key: str, default: list[str],
              valid: tuple[str, ...]) -> list[str]:
    value = raw.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: must be a list of strings, got {value!r}")
    for v in value:
        if v not in valid:
            raise ConfigError(f"{key}: {v!r} is not one of {list(valid)}")
    return value
