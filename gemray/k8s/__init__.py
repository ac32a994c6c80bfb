"""KubeRay manifests from a gemray config, so that deploy/*.yaml never drift from it.

* :mod:`gemray.k8s.render`: pure functions from a JobConfig (+ :class:`DeployOptions`) to ``RayJob`` /
  ``RayCluster`` / ``PersistentVolumeClaim`` dicts and YAML; how the config maps onto the cluster;
* :mod:`gemray.k8s.validate`: manifests against the KubeRay CRD schemas (jsonschema + PyYAML);
* :mod:`gemray.k8s.cli`: ``gemray k8s render | validate | regenerate`` and ``python -m gemray.k8s``.

Example::

    from gemray.k8s import DeployOptions, render_rayjob, to_yaml
    job = render_rayjob(cfg, DeployOptions(storage="pvc:gemray-data"))
    print(to_yaml(job))
"""

# Not re-exported: render.render (the dispatch on DeployOptions.kind) would hide the submodule of that name.
from gemray.k8s.render import (DeployOptions, render_cluster_spec, render_pvc, render_raycluster, render_rayjob,
                               to_yaml)
from gemray.k8s.validate import validate_files, validate_manifest

__all__ = ["DeployOptions", "render_cluster_spec", "render_pvc", "render_raycluster", "render_rayjob", "to_yaml",
           "validate_files", "validate_manifest"]
