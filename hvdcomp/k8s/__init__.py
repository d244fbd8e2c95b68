"""Kubernetes deployment: MPIJob manifests for the Kubeflow MPI Operator, rendered, validated offline, dry-run.

See :mod:`hvdcomp.k8s.render`, :mod:`hvdcomp.k8s.validate` and :mod:`hvdcomp.k8s.dryrun`; the command is
``hvdcomp k8s`` (:mod:`hvdcomp.k8s.cli`).
"""
