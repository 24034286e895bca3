"""``gpu-occupancy-exporter doctor``: what the exporter depends on, checked on this node
(docs/doctor.md)."""
