"""Check KubeRay manifests before `kubectl apply`: Ray kinds against the KubeRay v1 CRD schemas (``RayJob``,
``RayCluster``; the CRD YAML files of KubeRay release line v1.7, in ``shared/k8s/crds``), built-in kinds
through kubernetes-validate when it is installed. Needs jsonschema + PyYAML (`pip install jsonschema pyyaml`).

:func:`unknown_fields` is the pure part (keys a schema does not declare, which the API server would drop);
:func:`validate_manifest` checks one manifest dict, :func:`validate_files` YAML files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
_VALIDATORS: dict[tuple[str, str], Any] = {}


class NotAManifest(ValueError):
    """A file given to :func:`validate_files` that cannot be read as Kubernetes objects at all (not text, not
    YAML, no document, a document that is not a mapping): the wrong file given, not a manifest to judge."""


def yaml_error_text(e: Exception) -> str:
    """Pure: a PyYAML error ``e`` on one line that keeps where and what: ``line 5, column 1: could not find
    expected ':' (while scanning a simple key at line 4, column 1)`` (1-based, as editors count). ``str(e)`` is
    several lines with a source excerpt and a caret, and names the stream ``"<unicode string>"``; an error without
    marks falls back to it, whitespace collapsed."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(e).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        text += f" ({context}" + (f" at line {cmark.line + 1}, column {cmark.column + 1})" if cmark else ")")
    return text


def crd_validator(kind: str, crd_dir: str) -> Any:
    """A cached ``jsonschema.Draft7Validator`` for ``kind`` from ``crd_dir/<CRD file>``'s
    ``spec.versions[name=v1].schema.openAPIV3Schema``. Raises FileNotFoundError / ValueError."""
    import jsonschema
    import yaml

    if kind not in CRD_FILES:
        raise ValueError(f"no KubeRay CRD for kind {kind!r} (known: {sorted(CRD_FILES)})")
    path = Path(crd_dir) / CRD_FILES[kind]
    key = (kind, str(path.resolve()))
    if key not in _VALIDATORS:
        if not path.is_file():
            raise FileNotFoundError(f"KubeRay CRD not found: {path}")
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB of YAML
        crd = yaml.load(path.read_text(), Loader=loader)
        versions = [v for v in crd.get("spec", {}).get("versions", []) if v.get("name") == "v1"]
        if len(versions) != 1:
            raise ValueError(f"{path}: expected exactly one 'v1' version")
        schema = versions[0]["schema"]["openAPIV3Schema"]
        jsonschema.Draft7Validator.check_schema(schema)
        _VALIDATORS[key] = jsonschema.Draft7Validator(schema)
    return _VALIDATORS[key]


def validate_manifest(manifest: dict[str, Any], crd_dir: str) -> None:
    """Validate a RayJob/RayCluster dict against its KubeRay v1 CRD schema.

    Raises ``jsonschema.ValidationError`` (the most relevant error, with its path) when invalid or when a
    field is not in the schema (a misspelt key, which the API server would drop), and ValueError for a wrong
    apiVersion or a kind without a CRD here (built-in kinds: use kubernetes-validate, which in turn passes Ray
    kinds blindly).
    """
    import jsonschema

    kind = manifest.get("kind")
    if manifest.get("apiVersion") != "ray.io/v1":
        raise ValueError(f"{kind}: apiVersion must be ray.io/v1, got {manifest.get('apiVersion')!r}")
    validator = crd_validator(kind, crd_dir)
    err = jsonschema.exceptions.best_match(validator.iter_errors(manifest))
    if err is not None:
        raise err
    unknown = next(unknown_fields(manifest, validator.schema), None)
    if unknown is not None:  # what `kubectl apply` (strict field validation) refuses and the API server prunes
        raise jsonschema.ValidationError(f"unknown field {unknown[-1]!r} (not in the {kind} CRD schema)",
                                         path=list(unknown))
    spec = manifest.get("spec") or {}
    if kind == "RayJob":
        cluster, base = spec.get("rayClusterSpec") or {}, ["spec", "rayClusterSpec"]
    else:
        cluster, base = spec, ["spec"]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            raise jsonschema.ValidationError(f"minReplicas {lo} > maxReplicas {hi}",
                                             path=base + ["workerGroupSpecs", i, "minReplicas"])


def unknown_fields(doc: Any, schema: dict[str, Any], path: tuple = ()) -> Any:
    """Pure: yield the path (tuple of keys / indices) of every key of ``doc`` that its OpenAPI v3 ``schema``
    does not declare, where the schema lists ``properties`` and allows nothing else (no
    ``additionalProperties``, no ``x-kubernetes-preserve-unknown-fields``); arrays are checked item by item."""
    if isinstance(doc, dict) and schema.get("properties") and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key, val in doc.items():
            sub = schema["properties"].get(key)
            if sub is None:
                yield path + (key,)
            else:
                yield from unknown_fields(val, sub, path + (key,))
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, val in enumerate(doc):
            yield from unknown_fields(val, schema["items"], path + (i,))


def _document_label(doc: dict[str, Any]) -> str:
    """Pure: how a report names a document beside its position: ``"<kind> <name>"``, ``"<kind>, generateName
    <prefix>"`` or ``"<kind>, no metadata.name"`` (``"no kind"`` for a document without one)."""
    kind = doc.get("kind") or "no kind"
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    if meta.get("name"):
        return f"{kind} {meta['name']}"
    if meta.get("generateName"):
        return f"{kind}, generateName {meta['generateName']}"
    return f"{kind}, no metadata.name"


def validate_files(paths: list[str], crd_dir: str) -> list[str]:
    """Validate YAML files (one or more documents each); returns ``"<file> (document <n>, <kind> <name>): ok"``
    lines (a document without metadata.name is named by its position and kind, :func:`_document_label`).

    Ray kinds go against the CRDs; built-in kinds (PVC, Secret, ...) through kubernetes-validate when it
    is installed (strict, Kubernetes 1.32). Raises :class:`NotAManifest` (a ValueError) naming the file when it
    cannot be read as Kubernetes objects (not text, not YAML -- where and what the parser found, on one line:
    :func:`yaml_error_text` --, empty, a document that is not a mapping), ValueError naming the file and document
    when a manifest is invalid, and FileNotFoundError (naming the path and ``--crds``) when a KubeRay CRD file a
    document needs is not in ``crd_dir``.
    """
    import yaml

    class NoDuplicateKeys(yaml.SafeLoader):  # kubectl refuses a key given twice; PyYAML keeps the last one
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key_node.tag != "tag:yaml.org,2002:merge" and isinstance(key, (str, int, float, bool)):
                    if key in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                                key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    out = []
    for p in paths:
        try:
            docs = list(yaml.load_all(Path(p).read_text(), Loader=NoDuplicateKeys))
        except UnicodeDecodeError as e:
            raise NotAManifest(f"{p}: not a text file ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise NotAManifest(f"{p}: not valid YAML: {yaml_error_text(e)}") from None
        if not any(doc is not None for doc in docs):
            raise NotAManifest(f"{p}: no YAML documents (an empty file)")
        for i, doc in enumerate(docs):
            if doc is None:
                continue
            if not isinstance(doc, dict):
                raise NotAManifest(f"{p} (document {i + 1}): not a Kubernetes object (a {type(doc).__name__})")
            where = f"{p} (document {i + 1}, {_document_label(doc)})"
            meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
            if not (meta.get("name") or meta.get("generateName")):
                raise ValueError(f"{where}: invalid at 'metadata/name': a name (or generateName) is required")
            try:
                if doc.get("kind") in CRD_FILES:
                    validate_manifest(doc, crd_dir)
                else:
                    import kubernetes_validate

                    kubernetes_validate.validate(doc, "1.32", strict=True)
            except ImportError as e:
                raise ValueError(f"{where}: cannot validate a built-in kind: {e}") from None
            except FileNotFoundError as e:  # the CRD, not the manifest: the caller's usage error, kept apart
                raise FileNotFoundError(f"{e} (--crds names the folder of the KubeRay CRD YAML files)") from None
            except Exception as e:  # jsonschema / kubernetes_validate errors
                msg = getattr(e, "message", None) or str(e)
                path = "/".join(str(x) for x in getattr(e, "absolute_path", []) or [])
                raise ValueError(f"{where}: invalid at '{path}': {msg}") from None
            out.append(f"{where}: ok")
    return out
