"""Seeing inside a running application: the counters and vLLM stats the pools report,
the coordinator's sliding-window signals, Prometheus metrics, per-step timing records
and Grafana dashboards."""
