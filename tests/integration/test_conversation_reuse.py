"""Prefix reuse across the turns of a conversation, end to end: an orchestrator over a real
runner process. With `context_cache.enable_reuse`, each turn reuses the pages of the turns
before it (their prompts and replies), prefills fewer positions in all, and replies exactly
as a runner without reuse does."""

from __future__ import annotations

from pathlib import Path

from conversation import conversation_deployment, converse, user_turns, vocab_size

TURNS, USER, REPLY = 8, 24, 12


def test_eight_turns_prefill_less_with_reuse_and_reply_the_same(tmp_path: Path) -> None:
    runs = {}
    for reuse in (False, True):
        dep = conversation_deployment(tmp_path / f"reuse-{reuse}", reuse)
        try:
            users = user_turns(vocab_size(dep), TURNS, USER)
            runs[reuse] = list(converse(dep, users, REPLY))
            stats = dep.all_stages[0].wait_idle()
        finally:
            dep.close()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        hit_tokens = stats.get("prefix_cache_hit_tokens", 0)
        assert hit_tokens == sum(t.cached_tokens for t in runs[reuse])
    plain, reused = runs[False], runs[True]
    assert [t.reply for t in reused] == [t.reply for t in plain]
    assert all(len(t.reply) == REPLY for t in plain)
    assert [t.prompt_tokens for t in plain] == [USER + i * (USER + REPLY) for i in range(TURNS)]
    assert all(t.cached_tokens == 0 for t in plain)
    assert all(t.prefilled_tokens == t.prompt_tokens for t in plain)
    for t in reused:  # every turn prefills what it did not reuse
        assert t.cached_tokens + t.prefilled_tokens == t.prompt_tokens
    assert reused[0].cached_tokens == 0
    assert all(t.cached_tokens > 0 for t in reused[1:])  # later turns reuse earlier ones
    total_plain = sum(t.prefilled_tokens for t in plain)
    total_reused = sum(t.prefilled_tokens for t in reused)
    assert total_reused < total_plain / 2
