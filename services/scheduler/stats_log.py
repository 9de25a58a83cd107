"""The one-line engine stats that a serving scheduler logs while it has work, as vLLM does."""

from __future__ import annotations

from shared.protocol import HostTierStats, KVTransferStats, StatsSnapshot


class StatsLog:
    """Turns snapshots into a log line every `interval` seconds while tokens flow.

    Rates are over the interval since the last line. Idle intervals log nothing, except the
    first one, so that the log shows when the work stopped.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: tuple[float, StatsSnapshot] | None = None
        self._last_was_idle = True

    def line(self, now: float, stats: StatsSnapshot) -> str | None:
        if self._last is None:
            self._last = (now, stats)
            return None
        last_at, last = self._last
        elapsed = now - last_at
        if elapsed < self.interval:
            return None
        self._last = (now, stats)
        num_prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        num_generated = stats.num_generation_tokens - last.num_generation_tokens
        idle = num_prompt == num_generated == 0 and stats.num_running == stats.num_waiting == 0
        was_idle, self._last_was_idle = self._last_was_idle, idle
        if idle and was_idle:
            return None
        busy = (stats.device_busy_seconds - last.device_busy_seconds) / elapsed
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        return (
            f"prompt throughput: {num_prompt / elapsed:.1f} tok/s, "
            f"generation throughput: {num_generated / elapsed:.1f} tok/s, "
            f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_usage:.1%}, "
            f"prefix cache hit rate: {hits / queries if queries else 0.0:.1%}, "
            f"preemptions: {stats.num_preemptions}, "
            f"device busy: {busy:.1%}"
            + _speculation(last, stats)
            + _host_tier(last, stats)
            + _handovers(last, stats)
        )


def _handovers(last: StatsSnapshot, stats: StatsSnapshot) -> str:
    """Prefill/decode disaggregation over the interval: blocks handed over each way."""
    now, before = stats.kv_transfer, last.kv_transfer or KVTransferStats()
    if now is None:
        return ""
    return (
        f", KV handed over: {now.blocks_exported - before.blocks_exported} blocks out, "
        f"{now.blocks_imported - before.blocks_imported} in, "
        f"{now.failed_imports - before.failed_imports} fetches failed"
    )


def _host_tier(last: StatsSnapshot, stats: StatsSnapshot) -> str:
    """The host tier over the interval, where there is one: its hit rate among the prompt
    tokens the GPU missed, and blocks copied each way."""
    now, before = stats.host_tier, last.host_tier
    if now is None:
        return ""
    before = before or HostTierStats(num_blocks=now.num_blocks, block_bytes=now.block_bytes)
    queries, hits = now.queries - before.queries, now.hits - before.hits
    return (
        f", host KV tier: hit rate {hits / queries if queries else 0.0:.1%}, blocks to host "
        f"{now.blocks_to_host - before.blocks_to_host}, to GPU "
        f"{now.blocks_to_gpu - before.blocks_to_gpu}"
    )


def _speculation(last: StatsSnapshot, stats: StatsSnapshot) -> str:
    """Speculative decoding over the interval, where rows verified drafts (as vLLM logs it):
    tokens a verifying row moved on average, and the share of drafts accepted."""
    rows = stats.spec_num_drafts - last.spec_num_drafts
    if not rows:
        return ""
    drafts = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
    return (
        f", spec decode: mean acceptance length {1 + accepted / rows:.2f}, "
        f"draft acceptance rate {accepted / drafts if drafts else 0.0:.1%}"
    )
