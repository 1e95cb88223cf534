"""The published OpenAPI schemas of the custom resources the manifests use, vendored as JSON in
tests/deploy/crd_schemas/ (one file per kind, pinned to a release), and validation against them.

Each file holds the `openAPIV3Schema` of one version of the project's own CRD at a release tag
(`source`, `tag`, `commit` say which), descriptions dropped. The schemas come from the projects'
repositories (no package registry ships these CRDs); re-vendor with
`python tests/deploy/crd_schemas.py CRD.yaml REPO TAG COMMIT` (writes the served versions' files).

Validation is stricter than the API server's pruning: an object schema that lists properties and
neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` refuses any other
field, so a misspelt field fails here instead of vanishing on apply. CEL rules
(`x-kubernetes-validations`) are not evaluated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema

HERE = Path(__file__).parent / "crd_schemas"


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
        if out.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def load(api_version: str, kind: str) -> dict:
    """The vendored file of `kind` at `api_version` (KeyError naming what is vendored)."""
    for path in HERE.glob("*.json"):
        doc = json.loads(path.read_text())
        if doc["apiVersion"] == api_version and doc["kind"] == kind:
            return doc
    raise KeyError(
        f"no vendored schema for {api_version} {kind}: "
        f"{sorted(p.name for p in HERE.glob('*.json'))}"
    )


def errors(manifest: dict) -> list[str]:
    """Why `manifest` does not match its kind's vendored schema (empty: it does)."""
    doc = load(manifest["apiVersion"], manifest["kind"])
    validator = jsonschema.Draft7Validator(_strict(doc["schema"]))
    return [
        f"{manifest['kind']}/{manifest.get('metadata', {}).get('name')}: "
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(manifest)
    ]


def _drop_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _drop_descriptions(v)
            for k, v in node.items()
            if k != "description" or not isinstance(v, str)
        }
    if isinstance(node, list):
        return [_drop_descriptions(v) for v in node]
    return node


def vendor(crd_path: str, repo: str, tag: str, commit: str) -> list[Path]:
    import yaml

    crd = yaml.safe_load(Path(crd_path).read_text())
    spec, written = crd["spec"], []
    for version in spec["versions"]:
        if not version.get("served"):
            continue
        api_version = f"{spec['group']}/{version['name']}"
        out = HERE / f"{spec['names']['plural']}.{spec['group']}.{version['name']}.json"
        out.write_text(
            json.dumps(
                {
                    "apiVersion": api_version,
                    "kind": spec["names"]["kind"],
                    "source": f"{repo} {Path(crd_path).name}",
                    "tag": tag,
                    "commit": commit,
                    "schema": _drop_descriptions(version["schema"]["openAPIV3Schema"]),
                },
                sort_keys=True,
                separators=(",", ":"),
            )
            + "\n"
        )
        written.append(out)
    return written


if __name__ == "__main__":
    for p in vendor(*sys.argv[1:5]):
        print(p, p.stat().st_size)
