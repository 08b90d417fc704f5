"""Model types of mirror-mlx's own that mlx-lm loads by name: `mlx_lm.models.<type>` resolves to our module.

mlx-lm builds a folder's class from `mlx_lm.models.<model_type>`, so with the finder below (installed when
mirror_mlx is imported) a distilled draft (drafts/distilled/model.py) is a folder every loader takes as it is, in
this process and in the draft host; our module is imported on first use, never before.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys

TYPES = {"mlx_lm.models.mirror_distilled": "mirror_mlx.drafts.distilled.model"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in TYPES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(TYPES[spec.name])  # the same module object under both names

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
