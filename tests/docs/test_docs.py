"""The documentation keeps up with the code: README's length, the error catalogue, the troubleshooting guide."""

import importlib.util
import re

from tests.docs.code_blocks import REPO

spec = importlib.util.spec_from_file_location("gen_errors", REPO / "docs" / "gen_errors.py")
gen_errors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_errors)


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move reference material into docs/"


def test_error_catalogue_lists_every_raise_site():
    sites = gen_errors.raise_sites()
    assert len(sites) > 100
    committed = (REPO / "docs" / "guides" / "errors.md").read_text()
    assert committed == gen_errors.catalogue(), "docs/guides/errors.md is out of date: run python docs/gen_errors.py"
    for site in sites:
        assert f"`{site.module}.{site.function}`" in committed or f"`{site.module}`" in committed


def test_troubleshooting_covers_every_exception_class():
    """Each class meshlight defines, and each builtin class it raises, has its fix in the guide."""
    guide = (REPO / "docs" / "guides" / "troubleshooting.md").read_text()
    defined = gen_errors.exception_classes()
    assert {"PipelineError", "TensorParallelError", "ContextParallelError", "CheckpointError", "PlanError"} <= set(
        defined)
    raised = {site.exception.split(".")[-1] for site in gen_errors.raise_sites()}
    missing = sorted(name for name in set(defined) | raised if not re.search(rf"\*\*`{name}`\*\*", guide))
    assert not missing, f"docs/guides/troubleshooting.md does not explain: {missing}"
