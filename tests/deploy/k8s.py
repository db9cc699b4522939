"""deploy/k8s for the deploy tests: the base's objects, overlays rendered, strict validation.

Core kinds validate against the Kubernetes OpenAPI schemas bundled with `kubernetes-validate`
(strict: unknown fields fail). The CRDs those schemas lack validate against
deploy/k8s/schemas/: KEDA's ScaledObject (the fields the farm uses) and JobSet (its CRD's
schema, unknown fields refused), whose every replicated job's template is a batch/v1
JobTemplateSpec, validated strictly as a Job by the Kubernetes schemas.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.conftest import require
from tests.deploy.promql import DEPLOY

K8S = DEPLOY / "k8s"
KUBE_VERSION = "1.30.0"
SCHEMAS = {
    "ScaledObject": json.loads((K8S / "schemas" / "keda-scaledobject.schema.json").read_text()),
    "JobSet": json.loads((K8S / "schemas" / "jobset.schema.json").read_text()),
}


def validate(obj: dict[str, Any]) -> None:
    """Raise unless `obj` is valid for its kind (jsonschema's or kubernetes-validate's error)."""
    kind = obj["kind"]
    if kind not in SCHEMAS:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        return
    jsonschema.validate(obj, SCHEMAS[kind])
    if kind == "JobSet":
        for replicated in obj["spec"]["replicatedJobs"]:
            template = replicated["template"]
            meta = {"name": f"{obj['metadata']['name']}-{replicated['name']}-0"}
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta}
            kubernetes_validate.validate({**job, **template}, KUBE_VERSION, strict=True)


def base_objects() -> list[dict[str, Any]]:
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    objs = []
    for resource in kust["resources"]:
        objs.extend(d for d in yaml.safe_load_all((K8S / "base" / resource).read_text()) if d)
    return objs


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, rendered by `kubectl kustomize`."""
    require(shutil.which("kubectl") is not None, "kubectl (for kustomize rendering)")
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]
