"""gpu-occupancy-exporter: node-level GPU telemetry for Kubernetes."""

__version__ = "0.1.0"
