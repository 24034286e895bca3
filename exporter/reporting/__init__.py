"""What the exporter tells Kubernetes: Events on the pods and Node a GPU fault hits, an
opt-in ``GPUUnhealthy`` node condition and opt-in DRA device taints.

Analysis finds the health transitions (pure); ``events`` turns them into Event intents,
``recorder`` aggregates and rate-limits them as the kubelet's recorder does, and
``writer`` sends them from its own thread through ``kube_client``: best-effort, bounded,
counted, and never in the way of a sample cycle.
"""
