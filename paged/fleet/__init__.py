"""Several replicas: request routing (``routing``) and the prefill -> decode hand-over protocol
(``handover``)."""
