"""The tools around the plugin: ``hvdcomp train`` (:mod:`~hvdcomp.tools.train`) and its workloads
(:mod:`~hvdcomp.workloads`), ``hvdcomp bench`` (:mod:`~hvdcomp.tools.bench`), and the emulated cluster
(:mod:`~hvdcomp.tools.cluster`). The performance model (:mod:`hvdcomp.perfmodel`) and the Kubernetes tooling
(:mod:`hvdcomp.k8s`) are rooms of their own."""
