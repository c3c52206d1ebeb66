"""Prefix reuse over a multi-turn conversation, end to end: an orchestrator over a real runner
process (real gRPC on loopback ports), once with `context_cache.enable_reuse` and once
without.

Each turn's prompt is the previous prompt, its reply and a new user turn of --user token ids
(sent as ids, so earlier turns are the same tokens each time); replies are greedy, --reply
tokens long. Per turn, the runner's per-request Diagnostics (relayed in the orchestrator's
final report) give the positions reused (`cached_tokens`) and prefilled (`prefilled_tokens`);
after the conversation, the runner's stage-wide Diagnostics give `prefix_cache_hit_tokens`.
Prints both totals, their ratio, each turn's time to its final report, and whether the
replies are the same with and without reuse.

maxSeq is the whole conversation's length (stories260K's context is 512 positions).

Usage: python benchmarks/bench_conversation.py [--model stories260K|smollm2] [--turns 8]
                                               [--user 40] [--reply 16] [--system 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conversation import (  # noqa: E402
    Turn,
    conversation_deployment,
    converse,
    user_turns,
    vocab_size,
)


def run(tmp: Path, reuse: bool, args: argparse.Namespace) -> tuple[list[Turn], int, list[float]]:
    """The conversation on a fresh deployment: its turns, the runner's stage-wide
    prefix_cache_hit_tokens, and each turn's seconds."""
    max_seq = -(-(args.system + args.turns * (args.user + args.reply)) // 64) * 64
    dep = conversation_deployment(tmp, reuse, args.model, max_seq)
    try:
        users = user_turns(vocab_size(dep), args.turns, args.user)
        if args.system:  # a shared system prompt ahead of the first user turn
            users[0] = user_turns(vocab_size(dep), 1, args.system, seed=1)[0] + users[0]
        turns, times = [], []
        t0 = time.perf_counter()
        for turn in converse(dep, users, args.reply):
            turns.append(turn)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        stats = dep.all_stages[0].wait_idle()
    finally:
        dep.close()
    return turns, int(stats.get("prefix_cache_hit_tokens", 0)), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user", type=int, default=40)
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--system", type=int, default=0, help="system prompt tokens, turn 1")
    args = ap.parse_args()
    print(f"{args.model} on the numpy engine, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; {args.turns} turns, {args.user}-token user turns, "
          f"{args.reply}-token greedy replies, system prompt {args.system} tokens\n")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {reuse: run(Path(tmp) / f"reuse-{reuse}", reuse, args) for reuse in (False, True)}
    (plain, _, t_plain), (reused, hit_tokens, t_reused) = runs[False], runs[True]
    print("| turn | prompt | prefilled without reuse | cached | prefilled with reuse "
          "| ms without | ms with |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(plain, reused, strict=True)):
        print(f"| {i + 1} | {a.prompt_tokens} | {a.prefilled_tokens} | {b.cached_tokens} | "
              f"{b.prefilled_tokens} | {t_plain[i] * 1e3:,.0f} | {t_reused[i] * 1e3:,.0f} |")
    total_plain = sum(t.prefilled_tokens for t in plain)
    total_reused = sum(t.prefilled_tokens for t in reused)
    print(f"\nprefilled positions: {total_plain} without reuse, {total_reused} with "
          f"({total_reused / total_plain:.3f}x); runner's prefix_cache_hit_tokens {hit_tokens}")
    print(f"conversation time: {sum(t_plain):.2f} s without reuse, {sum(t_reused):.2f} s with")
    same = [a.reply for a in plain] == [b.reply for b in reused]
    print(f"replies identical with and without reuse: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
