"""Traffic for serving studies: ``Workload`` (requests with arrival times and an evidence label),
arrival processes and length distributions, the Azure traces, request specs, and the serving
metrics (TTFT, TPOT, ITL, E2E, goodput) computed from a run's records."""

from paged.workload.evidence import check_same_evidence
from paged.workload.request_spec import RequestSpec
from paged.workload.workload import Workload, load_azure_trace, make_workload

__all__ = ["RequestSpec", "Workload", "check_same_evidence", "load_azure_trace", "make_workload"]
