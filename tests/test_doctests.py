"""Every public name of torch_func_recipes shows an executed example: its docstring ends with an ``Example::``
section of doctest lines (``>>>``), and every doctest in the package's modules runs here and passes.

The examples run as a reader would paste them: with empty globals (each imports what it uses), on the CPU,
and they must write nothing to stderr (no warning either, but the one pytest.ini also ignores). Expected
output is compared with ELLIPSIS and NORMALIZE_WHITESPACE. The last two tests show that each check can fail."""
import contextlib
import doctest
import importlib
import inspect
import io
import pkgutil
import warnings
from types import ModuleType

import pytest

import torch_func_recipes

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
HEADING = "Example::"
JIT_SCRIPT_DEPRECATED = "`torch.jit.script` is deprecated"


def package_modules() -> list[ModuleType]:
    """The package and every module in it."""
    names = [f"{torch_func_recipes.__name__}.{info.name}" for info in pkgutil.iter_modules(torch_func_recipes.__path__)]
    return [torch_func_recipes] + [importlib.import_module(name) for name in sorted(names)]


def find_doctests(obj: object) -> list[doctest.DocTest]:
    """The doctests (docstrings with examples) in obj, a module or a function, each with empty globals."""
    return [test for test in doctest.DocTestFinder().find(obj, globs={}) if test.examples]


DOCTESTS = {test.name: test for module in package_modules() for test in find_doctests(module)}


def run(test: doctest.DocTest) -> tuple[doctest.TestResults, str]:
    """Run one doctest: (its results, the runner's report). Anything the examples write to stderr, and every
    warning they raise (under the "always" filter), counts as one more failure and is added to the report."""
    report: list[str] = []
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
        warnings.simplefilter("always")
        # torch's own words on its first forward-mode call (torch.func.hessian, jvp), raised inside torch and so
        # hidden by Python's default filters; pytest.ini and book/_shared/basics.py ignore it the same way
        warnings.filterwarnings("ignore", message=JIT_SCRIPT_DEPRECATED, category=DeprecationWarning)
        results = doctest.DocTestRunner(optionflags=FLAGS).run(test, out=report.append)
    noise = [f"warning: {w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    noise += [f"stderr: {line}" for line in stderr.getvalue().splitlines()]
    if noise:
        results = doctest.TestResults(results.failed + 1, results.attempted)
        report.append(f"{test.name} wrote to stderr:\n" + "\n".join(noise) + "\n")
    return results, "".join(report)


def missing_example(obj: object) -> str | None:
    """Why obj's docstring shows no example, or None when it ends with an Example:: section of doctest lines."""
    doc = inspect.getdoc(obj)
    if not doc:
        return "no docstring"
    _, heading, section = doc.partition(f"\n{HEADING}\n")
    if not heading:
        return f"no {HEADING} section"
    if not doctest.DocTestParser().get_examples(section):
        return f"its {HEADING} section has no >>> lines"
    return None


@pytest.mark.parametrize("name", sorted(DOCTESTS), ids=lambda name: name.removeprefix("torch_func_recipes."))
def test_doctest_passes(name):
    results, report = run(DOCTESTS[name])
    assert results.attempted > 0
    assert results.failed == 0, f"the examples of {name} fail:\n{report}"


@pytest.mark.parametrize("name", sorted(torch_func_recipes.__all__))
def test_public_name_has_an_example(name):
    obj = getattr(torch_func_recipes, name)
    problem = missing_example(obj)
    assert problem is None, f"{name}: {problem}: add an {HEADING} section of doctest lines at the end of its docstring"
    assert f"{obj.__module__}.{obj.__qualname__}" in DOCTESTS, f"{name}'s examples are not among the doctests this file runs"


def right(x):
    """Add one.

    Example::

        >>> right(1)
        2
    """
    return x + 1


def wrong(x):
    """Add one, with a wrong expected output.

    Example::

        >>> wrong(1)
        3
    """
    return x + 1


def noisy(x):
    """Add one, with a warning.

    Example::

        >>> import warnings
        >>> noisy(1)
        2
    """
    warnings.warn("a warning the example does not expect", UserWarning)
    return x + 1


def test_the_runner_reports_a_wrong_output_and_a_warning():
    """The runner fails a wrong expected output, showing it, and an example that warns; a right one passes."""
    (test,) = find_doctests(right)
    test.globs["right"] = right
    assert run(test) == (doctest.TestResults(0, 1), "")
    (test,) = find_doctests(wrong)
    test.globs["wrong"] = wrong
    results, report = run(test)
    assert results == doctest.TestResults(1, 1)
    assert "Expected:\n    3\nGot:\n    2" in report
    (test,) = find_doctests(noisy)
    test.globs["noisy"] = noisy
    results, report = run(test)
    assert results.failed == 1 and "UserWarning: a warning the example does not expect" in report


def test_the_example_check_flags_a_docstring_without_one():
    def no_example(x):
        """Add one.

        Args:
            x (int): a number.

        Returns:
            x + 1.
        """

    def empty_section(x):
        """Add one.

        Example::

            right(x) is x + 1
        """

    def undocumented(x):
        pass

    assert missing_example(no_example) == f"no {HEADING} section"
    assert missing_example(empty_section) == f"its {HEADING} section has no >>> lines"
    assert missing_example(undocumented) == "no docstring"
    assert missing_example(right) is None
