"""Prometheus text exposition of kvflow's metrics; names mirror vLLM's with `kvflow:`."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec

from shared.protocol import StatsSnapshot

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {total}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{self.name}_count{{{labels}}} {total}")
        return lines


class FrontendFigures(msgspec.Struct, forbid_unknown_fields=True):
    """One frontend's request-level figures, as frontends run side by side share them
    (services/frontend/metrics/share.py)."""

    histograms: dict[str, tuple[list[int], float]]  # name -> (bucket counts, sum)
    finished: dict[str, int]
    refused: dict[str, int]
    in_flight: int


class Metrics:
    """Request-level figures measured in the frontend, plus the scheduler's latest snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.labels = f'model_name="{model_name}"'
        self.ttft = Histogram("kvflow:time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("kvflow:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = Histogram("kvflow:e2e_request_latency_seconds", "End-to-end latency.")
        self.finished: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # requests refused up front, by reason

    def figures(self, num_in_flight: int) -> FrontendFigures:
        histograms = {h.name: (list(h.counts), h.sum) for h in (self.ttft, self.itl, self.e2e)}
        return FrontendFigures(histograms, dict(self.finished), dict(self.refused), num_in_flight)

    def merged(self, peers: Sequence[FrontendFigures]) -> Metrics:
        """These figures plus other frontends' (a peer whose buckets differ is left out)."""
        total = Metrics(self.model_name)
        for figures in (self.figures(0), *peers):
            total._add(figures)
        return total

    def _add(self, figures: FrontendFigures) -> None:
        histograms = (self.ttft, self.itl, self.e2e)
        parts = [figures.histograms.get(h.name) for h in histograms]
        for histogram, part in zip(histograms, parts, strict=True):
            if part is None or len(part[0]) != len(histogram.counts):
                return
        for histogram, part in zip(histograms, parts, strict=True):
            assert part is not None
            counts, part_sum = part
            histogram.counts = [a + b for a, b in zip(histogram.counts, counts, strict=True)]
            histogram.sum += part_sum
        self.finished.update(figures.finished)
        self.refused.update(figures.refused)

    def render(
        self, snapshots: Sequence[StatsSnapshot], num_tokenizer_workers: int, num_in_flight: int
    ) -> str:
        """`snapshots`: each engine replica's latest, in replica order; their figures carry a
        `replica` label."""
        lines = _sample(
            "kvflow:num_tokenizer_workers",
            "gauge",
            "Tokenizer workers taking requests (alive and not draining).",
            [(self.labels, num_tokenizer_workers)],
        )
        lines += _sample(
            "kvflow:frontend_requests_in_flight",
            "gauge",
            "Requests this frontend has sent to the engine and not seen end (its own load).",
            [(self.labels, num_in_flight)],
        )
        for name, kind, doc, value in _ENGINE_FIGURES:
            samples = [(f'{self.labels},replica="{s.replica}"', value(s)) for s in snapshots]
            if samples:
                lines += _sample(f"kvflow:{name}", kind, doc, samples)
        lines += _accepted_per_position(self.labels, snapshots)
        lines += _expert_tokens(self.labels, snapshots)
        lines += [
            "# HELP kvflow:request_success_total Finished requests by reason.",
            "# TYPE kvflow:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort", "error", "timeout"):
            lines.append(
                f'kvflow:request_success_total{{{self.labels},finished_reason="{reason}"}}'
                f" {self.finished[reason]}"
            )
        lines += [
            "# HELP kvflow:request_refused_total Requests refused (429) because the waiting"
            " queue was full.",
            "# TYPE kvflow:request_refused_total counter",
            f'kvflow:request_refused_total{{{self.labels},reason="queue_full"}}'
            f" {self.refused['queue_full']}",
        ]
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(self.labels)
        return "\n".join(lines) + "\n"


def _sample(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric: its help and type, then a line per set of labels."""
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    return lines + [f"{name}{{{labels}}} {value}" for labels, value in samples]


Figure = Callable[[StatsSnapshot], float]


def _host_tier(field: str, in_bytes: bool = False) -> Figure:
    """A HostTierStats field of a snapshot (0 without a host tier); `in_bytes`: a count of
    blocks, as bytes."""

    def read(stats: StatsSnapshot) -> float:
        tier = stats.host_tier
        if tier is None:
            return 0
        value: float = getattr(tier, field)
        return value * tier.block_bytes if in_bytes else value

    return read


_ENGINE_FIGURES: list[tuple[str, str, str, Figure]] = [
    ("num_requests_running", "gauge", "Requests in the running batch.", lambda s: s.num_running),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    (
        "num_prompt_tokens_waiting",
        "gauge",
        "Tokens the waiting requests owe (bounded by --max-queued-tokens).",
        lambda s: s.num_waiting_tokens,
    ),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).", lambda s: s.kv_usage),
    (
        "prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up.",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "prefix_cache_hits_total",
        "counter",
        "Prompt tokens found cached.",
        lambda s: s.prefix_cache_hits,
    ),
    ("num_preemptions_total", "counter", "Preemptions by recompute.", lambda s: s.num_preemptions),
    ("prompt_tokens_total", "counter", "Prompt tokens processed.", lambda s: s.num_prompt_tokens),
    ("generation_tokens_total", "counter", "Tokens generated.", lambda s: s.num_generation_tokens),
    (
        "device_busy_seconds_total",
        "counter",
        "Seconds the device ran steps (its rate is the busy fraction; 0 on CPU).",
        lambda s: s.device_busy_seconds,
    ),
    (
        "spec_decode_num_drafts_total",
        "counter",
        "Rows that verified drafts (speculative decoding).",
        lambda s: s.spec_num_drafts,
    ),
    (
        "spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens verified.",
        lambda s: s.spec_num_draft_tokens,
    ),
    (
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted.",
        lambda s: s.spec_num_accepted_tokens,
    ),
    (
        "external_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the host KV tier (past the GPU's hits).",
        _host_tier("queries"),
    ),
    (
        "external_prefix_cache_hits_total",
        "counter",
        "Prompt tokens restored from the host KV tier.",
        _host_tier("hits"),
    ),
    (
        "kv_offload_bytes_to_host_total",
        "counter",
        "KV bytes copied from the GPU to the host tier (evicted blocks).",
        _host_tier("blocks_to_host", in_bytes=True),
    ),
    (
        "kv_offload_bytes_to_gpu_total",
        "counter",
        "KV bytes copied from the host tier back to the GPU (prefix hits there).",
        _host_tier("blocks_to_gpu", in_bytes=True),
    ),
    (
        "kv_offload_bytes_to_disk_total",
        "counter",
        "KV bytes written to the disk tier (--kv-offloading-disk-path).",
        _host_tier("blocks_to_disk", in_bytes=True),
    ),
    (
        "kv_offload_bytes_from_disk_total",
        "counter",
        "KV bytes read back from the disk tier into the host tier (prefix hits there).",
        _host_tier("blocks_from_disk", in_bytes=True),
    ),
    (
        "kv_offload_disk_read_seconds_total",
        "counter",
        "Seconds the executor spent reading disk-tier files.",
        _host_tier("disk_read_seconds"),
    ),
    (
        "kv_offload_disk_write_seconds_total",
        "counter",
        "Seconds the executor spent writing disk-tier files.",
        _host_tier("disk_write_seconds"),
    ),
    (
        "kv_offload_disk_misses_total",
        "counter",
        "Disk-tier reads that found no good file (missing or corrupted: computed instead).",
        _host_tier("disk_misses"),
    ),
    (
        "kv_transfer_blocks_exported_total",
        "counter",
        "KV blocks of prompts a prefill replica handed over to decode replicas.",
        lambda s: s.kv_transfer.blocks_exported if s.kv_transfer else 0,
    ),
    (
        "kv_transfer_blocks_imported_total",
        "counter",
        "KV blocks a decode replica fetched from prefill replicas.",
        lambda s: s.kv_transfer.blocks_imported if s.kv_transfer else 0,
    ),
    (
        "kv_transfer_bytes_imported_total",
        "counter",
        "KV bytes a decode replica fetched from prefill replicas.",
        lambda s: s.kv_transfer.blocks_imported * s.kv_transfer.block_bytes if s.kv_transfer else 0,
    ),
    (
        "kv_transfer_import_seconds_total",
        "counter",
        "Time a decode replica's executor spent fetching handed-over KV and copying it in.",
        lambda s: s.kv_transfer.import_seconds if s.kv_transfer else 0,
    ),
    (
        "kv_transfer_failed_imports_total",
        "counter",
        "Handed-over prompts whose KV a decode replica could not fetch (computed again there).",
        lambda s: s.kv_transfer.failed_imports if s.kv_transfer else 0,
    ),
]


def _accepted_per_position(labels: str, snapshots: Sequence[StatsSnapshot]) -> list[str]:
    """vLLM's spec_decode_num_accepted_tokens_per_pos: drafts accepted at each position."""
    samples: list[tuple[str, float]] = [
        (f'{labels},replica="{s.replica}",position="{position}"', count)
        for s in snapshots
        for position, count in enumerate(s.spec_accepted_per_position)
    ]
    return _sample(
        "kvflow:spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Draft tokens accepted at each position of their row (0: the first draft).",
        samples,
    )


def _expert_tokens(labels: str, snapshots: Sequence[StatsSnapshot]) -> list[str]:
    """A mixture of experts' load: each expert's choices by tokens (every layer's added up),
    with the rank that holds it whole under expert parallelism ("all": a part on each)."""
    samples: list[tuple[str, float]] = [
        (f'{labels},replica="{s.replica}",expert="{expert}",rank="{_rank(rank)}"', count)
        for s in snapshots
        for expert, (count, rank) in enumerate(zip(s.expert_tokens, s.expert_ranks, strict=True))
    ]
    if not samples:
        return []
    return _sample(
        "kvflow:moe_expert_tokens_total",
        "counter",
        "Tokens routed to each expert, every layer's choices added up (its rank: the GPU that"
        " holds it whole with --enable-expert-parallel, else all).",
        samples,
    )


def _rank(rank: int) -> str:
    return "all" if rank < 0 else str(rank)
