"""The kubelet's PodResources v1 gRPC API: ``api.proto`` (copied from upstream) and the
stubs ``generate.sh`` makes from it.

A protocol, not a layer: the client (``exporter.sources.podresources``) and the
simulated kubelet (``exporter.sim.podresources_server``) both speak it, so it lives
beside them rather than inside either.
"""
