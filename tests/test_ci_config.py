"""CI's own configuration: a verdict that depends on the commit alone (the lock, no newest-release
step), self-hosted runners that never run a fork's code, the weekly newest-torch report, and the
commit-msg hook. Each check also runs on a broken copy, to show that it can fail."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bookcheck import ROOT
from scripts import check_commit_msg, execute_notebooks, lock, newest_torch_report

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
# Events a fork can set off that run in, or check out code into, a privileged context.
FORK_EVENTS = {"pull_request_target", "issue_comment", "workflow_run", "pull_request_review",
               "pull_request_review_comment", "discussion_comment"}
SAME_REPO = "github.event.pull_request.head.repo.full_name == github.repository"


def load(path: Path) -> dict:
    workflow = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as the boolean True.
    if True in workflow:
        workflow["on"] = workflow.pop(True)
    return workflow


def triggers(workflow: dict) -> set[str]:
    on = workflow["on"]
    return {on} if isinstance(on, str) else set(on)


def self_hosted_problems(workflow: dict, name: str = "") -> list[str]:
    """Ways a fork's pull request could run code on a self-hosted runner of `workflow`."""
    problems = []
    events = triggers(workflow)
    for job_name, job in workflow.get("jobs", {}).items():
        runs_on = job.get("runs-on", [])
        labels = [runs_on] if isinstance(runs_on, str) else list(runs_on)
        if "self-hosted" not in labels:
            continue
        for event in sorted(events & FORK_EVENTS):
            problems.append(f"{name} job {job_name}: a self-hosted job triggered by {event}")
        if "pull_request" in events and SAME_REPO not in str(job.get("if", "")):
            problems.append(f"{name} job {job_name}: a self-hosted job on pull_request without the "
                            f"same-repository condition ({SAME_REPO})")
    return problems


def test_no_self_hosted_job_runs_a_forks_pull_request():
    assert any("self-hosted" in str(job.get("runs-on")) for p in WORKFLOWS for job in load(p)["jobs"].values())
    assert [problem for p in WORKFLOWS for problem in self_hosted_problems(load(p), p.name)] == []


def test_the_self_hosted_check_catches_fork_triggers():
    cuda = load(ROOT / ".github" / "workflows" / "nbval-cuda.yml")
    unguarded = copy.deepcopy(cuda)
    del unguarded["jobs"]["nbval-cuda"]["if"]
    assert "without the same-repository condition" in " ".join(self_hosted_problems(unguarded))
    targeted = copy.deepcopy(cuda)
    targeted["on"]["pull_request_target"] = None
    assert "triggered by pull_request_target" in " ".join(self_hosted_problems(targeted))
    as_string = copy.deepcopy(unguarded)
    as_string["on"] = "pull_request"
    assert self_hosted_problems(as_string)


def test_the_cuda_workflow_runs_the_cuda_tests_unskipped():
    """tests/test_cuda.py is skipped on every machine without a GPU, so it must run where there is one: the CUDA
    workflow's steps call `make cuda-tests`, which turns skip marks off (a runner whose GPU is not visible fails)."""
    steps = " ".join(str(step.get("run", "")) for step in load(ROOT / ".github" / "workflows" / "nbval-cuda.yml")["jobs"]["nbval-cuda"]["steps"])
    assert "make cuda-tests" in steps and "make nbval" in steps
    target = (ROOT / "Makefile").read_text().split("\ncuda-tests:", 1)[1].split("\n\n", 1)[0]
    assert "-p no:skipping tests/test_cuda.py" in target, target


def test_ci_tests_the_commit_and_newest_torch_is_scheduled():
    ci = load(ROOT / ".github" / "workflows" / "ci.yml")
    assert ".ci/run" in str(ci["jobs"])
    run_script = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in run_script.splitlines() if not line.lstrip().startswith("#")]
    assert "make test" in "\n".join(commands)
    assert not [line for line in commands if "newest" in line or "--upgrade" in line], "CI must test the commit alone"
    newest = load(ROOT / ".github" / "workflows" / "newest-torch.yml")
    assert triggers(newest) == {"schedule", "workflow_dispatch"}
    assert "TORCH=newest" in str(newest["jobs"]) and "issues" in newest["permissions"]


# --- the lock ------------------------------------------------------------------------------

def requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(lock.canonical(line.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()))
    return names


def test_the_lock_holds_every_requirement_at_its_direct_pin():
    pins = lock.read()
    wanted = set().union(*(requirement_names(p) for p in ROOT.glob("requirements*.txt") if p.suffix == ".txt"))
    assert {name for name in wanted if lock.locked(name)} - set(pins) == set()
    direct = {lock.canonical(line.split("==")[0]): line.split("==")[1].split()[0]
              for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line and not line.startswith("#")}
    assert {name: version for name, version in direct.items() if lock.locked(name) and pins.get(name) != version} == {}
    assert "torch" in direct and "torch" not in pins and not [n for n in pins if n.startswith("nvidia")]


def test_the_colab_lock_holds_every_colab_package_at_its_release():
    pins = lock.read(ROOT / "colab-packages.lock")
    listed = {lock.canonical(line.split("==")[0]): line.split("==")[1].strip()
              for line in (ROOT / "colab-packages.txt").read_text().splitlines() if "==" in line and not line.startswith("#")}
    assert "torch" in listed and "torch" not in pins
    assert {name: version for name, version in listed.items() if lock.locked(name) and pins.get(name) != version} == {}


def test_the_lock_check_catches_an_unlocked_a_moved_and_a_missing_package():
    pins = {"numpy": "2.4.6", "pytest": "8.4.2"}
    assert lock.problems(pins, dict(pins), partial=False) == []
    assert lock.problems(pins, {**pins, "left-pad": "1.0"}, partial=True) == ["left-pad 1.0 is installed but not in the lock"]
    assert lock.problems(pins, {**pins, "numpy": "2.5.0"}, partial=True) == [
        "numpy 2.5.0 is installed, the lock says 2.4.6"]
    assert lock.problems(pins, {"numpy": "2.4.6"}, partial=False) == ["pytest 8.4.2 is in the lock but not installed"]
    assert lock.problems(pins, {"numpy": "2.4.6"}, partial=True) == []


def test_this_environment_matches_the_lock():
    """`make env` ran the check; this reruns it in the environment running the tests (one that make
    built, for any torch release: the lock leaves torch's family out)."""
    if not list(Path(sys.prefix).glob(".installed-torch-*")):
        pytest.skip(f"{sys.prefix} was not built by make")
    assert lock.problems(lock.read(), lock.installed(), partial=False) == []


def test_setuptools_vendored_copies_are_not_read_as_installed():
    """Importing setuptools (torch.utils.benchmark does) appends setuptools/_vendor to sys.path, where
    importlib.metadata then finds vendored copies of packages at other releases; the environment check reads
    the install directories only, so it is unmoved (it failed CI once, with 12 such entries)."""
    import importlib.metadata

    import setuptools  # noqa: F401

    assert any("_vendor" in p for p in sys.path)
    everywhere = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions() if "_vendor" in str(d.locate_file(""))}
    assert everywhere, "no vendored copies visible: the trap this test guards against is not set"
    assert not {name for name in everywhere if name not in lock.read()} & set(lock.installed())


# --- the weekly newest-torch report --------------------------------------------------------

def test_the_newest_torch_report_lists_each_failing_cell(tmp_path):
    (tmp_path / "test_cells.py").write_text(
        "def test_cell_1():\n    pass\n\n"
        "def test_cell_2():\n    assert 1 == 2, 'output differs'\n\n"
        "def test_cell_3():\n    raise RuntimeError('kernel died')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", "test_cells.py"],
                   cwd=tmp_path, capture_output=True, check=False)
    cells = newest_torch_report.failing_cells(junit)
    assert [test_id.rsplit("::", 1)[-1] for test_id, _ in cells] == ["test_cell_2", "test_cell_3"]
    assert "output differs" in cells[0][1] and "kernel died" in cells[1][1]
    body = newest_torch_report.report(junit, "torch 9.9.9", "https://example.invalid/run/1")
    assert "failing cells: 2" in body and "torch 9.9.9" in body and "test_cell_1" not in body


# --- commit messages -----------------------------------------------------------------------

@pytest.mark.parametrize("message, ok", [
    ("Move the build tools to scripts/\n\nDetails here.\n", True),
    ("# a comment git adds\nFix the lock check\n", True),
    ("x" * 72 + "\n", True),
    ("x" * 73 + "\n", False),
    ("Subject\nbody without a blank line\n", False),
    ("# only comments\n\n", False),
])
def test_commit_subject_hook(message, ok, tmp_path):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    assert (check_commit_msg.main([str(path)]) == 0) is ok
    hook = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entry = next(h for repo in hook["repos"] for h in repo["hooks"] if h["id"] == "commit-subject")
    assert entry["stages"] == ["commit-msg"] and "commit-msg" in hook["default_install_hook_types"]


def test_stored_outputs_are_made_without_huge_pages(tmp_path, monkeypatch):
    """execute_notebooks runs the kernel without THP_MEM_ALLOC_ENABLE, whatever the caller's environment (huge pages
    change the stored timings' ratios), and gives the caller's setting back; a failed run writes nothing."""
    seen = []

    class Recording:
        def __init__(self, *args, **kwargs):
            pass

        def execute(self):
            seen.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
            raise RuntimeError("stop here: the environment is what is tested")

    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```{code-cell} ipython3\nprint(1)\n```\n")
    monkeypatch.setattr(execute_notebooks, "NotebookClient", Recording)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        execute_notebooks.execute(page)
    assert seen == [None] and os.environ["THP_MEM_ALLOC_ENABLE"] == "1" and not page.with_suffix(".ipynb").exists()
