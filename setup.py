"""Build hook: the wheel carries `recipes/`, `accelerate_configs/` and `eval/*.yaml` as `appo_trl/_resources/`.

Package metadata lives in pyproject.toml. These folders sit at the top of the repository (where a user of a
checkout looks for them); `appo_trl.configs.paths` finds them there in a checkout or an editable install, and
under `appo_trl/_resources/` in an installed wheel, so `pip install appo-trl && appo demo` works anywhere.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# folder -> file patterns shipped (recipes, their tiny data, launcher configs, eval configs; no scripts)
SHIPPED = {
    "recipes": ("*.yaml", "*.jsonl", "*.json", "*.py"),  # *.py: custom tools next to a recipe (tools.calculator)
    "accelerate_configs": ("*.yaml",),
    "eval": ("*.yaml", "*.jsonl", "*.json"),  # eval configs and the tiny eval sets (eval/data/tiny)
}


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout itself
        root = Path(__file__).resolve().parent
        for folder, patterns in SHIPPED.items():
            for src in sorted((root / folder).rglob("*")):
                if src.is_file() and any(src.match(p) for p in patterns):
                    dst = Path(self.build_lib, "appo_trl", "_resources", src.relative_to(root))
                    self.mkpath(str(dst.parent))
                    self.copy_file(str(src), str(dst))


setup(cmdclass={"build_py": BuildPyWithResources})
