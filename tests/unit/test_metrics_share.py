"""Frontends side by side (--api-server-count) share their request metrics through files: the
/metrics of any one counts every frontend's requests, histograms bucket by bucket, and a file
that cannot be read is left out rather than break the scrape."""

from __future__ import annotations

from pathlib import Path

from services.frontend.metrics.prometheus import Metrics
from services.frontend.metrics.share import MetricsShare


def frontend(
    name: str, folder: Path, finished: dict[str, int], ttfts: list[float]
) -> tuple[Metrics, MetricsShare]:
    metrics = Metrics("m")
    metrics.finished.update(finished)
    for ttft in ttfts:
        metrics.ttft.observe(ttft)
    return metrics, MetricsShare(str(folder), name)


def test_each_frontends_metrics_count_every_frontends_requests(tmp_path: Path) -> None:
    a, share_a = frontend("a", tmp_path, {"stop": 2}, [0.01, 3.0])
    b, share_b = frontend("b", tmp_path, {"stop": 1, "length": 4}, [0.01])
    share_a.write(a.figures(num_in_flight=1))
    share_b.write(b.figures(num_in_flight=2))
    (tmp_path / "frontend-c.json").write_text("{not json")  # half-written or foreign: skipped
    peers = share_a.peers()
    assert [p.in_flight for p in peers] == [2]  # its own file is not a peer
    total = a.merged(peers)
    assert total.finished == {"stop": 3, "length": 4}
    assert sum(total.ttft.counts) == 3 and abs(total.ttft.sum - 3.02) < 1e-9
    text = total.render([], num_tokenizer_workers=1, num_in_flight=3)
    assert 'kvflow:request_success_total{model_name="m",finished_reason="length"} 4' in text
    assert 'kvflow:time_to_first_token_seconds_count{model_name="m"} 3' in text
    assert a.finished == {"stop": 2}  # merging leaves the frontend's own figures alone


def test_a_newer_write_replaces_the_last_whole(tmp_path: Path) -> None:
    a, share_a = frontend("a", tmp_path, {"stop": 1}, [])
    _, share_b = frontend("b", tmp_path, {}, [])
    share_a.write(a.figures(0))
    a.finished["stop"] += 5
    share_a.write(a.figures(0))
    assert [p.finished for p in share_b.peers()] == [{"stop": 6}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frontend-a.json"]
