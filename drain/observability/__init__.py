"""What the drain tells its operators: metrics, health endpoints, logs and tracing."""
