"""Decision spans (OpenTelemetry), Prometheus metrics and the decision log."""
