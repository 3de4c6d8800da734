"""What operators see: Prometheus metrics, the rolling per-worker window and the dashboard page."""
