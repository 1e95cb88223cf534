"""Which filesystem paths a caller may make this worker read: weights for UpdateWeights and
LoRA adapters (LoadLoRAAdapter, and the adapter a request names). With roots configured
(--allowed-model-paths), a path must resolve (symlinks followed) inside one of them; one that
does not is refused before anything at it is opened, and the answer is the same whether or
not it exists, so a caller learns nothing about the filesystem outside the roots."""

from __future__ import annotations

import os

from worker_runtime.grpc_errors import PermissionDenied


class AllowedPaths:
    def __init__(self, roots: tuple[str, ...]) -> None:
        self._roots = tuple(os.path.realpath(r) for r in roots)

    def check(self, path: str, what: str) -> None:
        """PermissionDenied unless `path` lies under a root (always fine without roots)."""
        if not self._roots:
            return
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self._roots):
            raise PermissionDenied(f"{what} {path!r} is outside --allowed-model-paths")
