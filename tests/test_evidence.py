"""Evidence labels cannot be mislabelled: a trace says what it is, or the caller does."""

from __future__ import annotations

from pathlib import Path

import ml_collections
import pytest

from experiments import serving
from experiments.configs import serve as serve_config
from paged.workload import metrics
from paged.workload import workload as wl

TRACE = Path(__file__).resolve().parents[1] / "experiments" / "traces" / "tiny_constructed.jsonl"


def _strip_header(tmp_path) -> Path:
    lines = [line for line in TRACE.read_text().splitlines() if '"workload"' not in line]
    path = tmp_path / "hand_written.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hand_written_trace_without_header_is_not_real(tmp_path):
    assert wl.Workload.from_jsonl(TRACE).evidence == "constructed"  # its header says so
    path = _strip_header(tmp_path)
    with pytest.raises(ValueError, match="does not say what it is"):
        wl.Workload.from_jsonl(path)
    assert wl.Workload.from_jsonl(path, evidence="constructed").evidence == "constructed"
    with pytest.raises(ValueError, match="evidence='real' but"):
        wl.Workload.from_jsonl(TRACE, evidence="real")  # the header wins no argument


def _workload_config(**changes) -> ml_collections.ConfigDict:
    w = serve_config.workload_defaults()
    w.num_requests = 4
    for k, v in changes.items():
        w[k] = v
    return w


def test_study_workload_labels(tmp_path):
    path = _strip_header(tmp_path)
    with pytest.raises(ValueError, match="workload.evidence"):
        serving.build_workload(_workload_config(trace=str(path)), 256)
    got = serving.build_workload(_workload_config(trace=str(path), evidence="real"), 256)
    assert got.evidence == "real"  # the user said so
    assert serving.build_workload(_workload_config(), 256).evidence == "constructed"
    with pytest.raises(ValueError, match="labels a trace"):
        serving.build_workload(_workload_config(evidence="real"), 256)  # made here: constructed


def test_simulated_label_and_no_mixing():
    c = wl.make_workload("alpaca", 3, 1.0, max_model_len=128, seed=0)
    sim = wl.Workload(name="sim", requests=c.requests, evidence="simulated", seed=None)
    assert wl.check_same_evidence([sim, sim]) == "simulated"
    with pytest.raises(ValueError, match="must not mix"):
        wl.check_same_evidence([c, sim])
    assert "simulated" in metrics.EVIDENCE
    rec = metrics.RequestRecord("a", "finished", 0.0, 0.0, 0.1, 0.2, (0.1, 0.2), 3, 2)
    assert metrics.summarize([rec], duration_s=1.0, evidence="simulated")["evidence"] == "simulated"
