"""The source tree's own rules: the folders are layers and includes point downward only,
the include graph has no cycle, no OpenMP anywhere (kernels/threads.c is the team), code comments carry no measured timings or commit hashes (those
belong in docs/PERFORMANCE.md and commit messages), and README.md stays a short
user's page."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The engine's folders, bottom first: a file may include its own layer and those below it.
# The tokenizer stands on the side: it needs only the bottom layer, and the model and
# serving layers may use it.
LAYERS = {"kernels": 0, "tokenizer": 1, "": 2, "serve": 3}
SOURCES = sorted(
    os.path.join(d, f) if d else f
    for d in LAYERS
    for f in os.listdir(os.path.join(ROOT, d))
    if f.endswith((".c", ".h", ".cc")))
APP = "run.c"  # main: the one file above serve/
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
TIMING = re.compile(r"\b\d+(\.\d+)?\s*(ms|us|µs|ns|GFLOP/s|GB/s|tokens/s)\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def module_graph():
    """module (path without extension, from the root) -> the modules it includes"""
    graph = {}
    for name in SOURCES:
        module = os.path.splitext(name)[0]
        deps = {os.path.splitext(d)[0] for d in re.findall(r'#include "([^"]+)"', read(name))}
        graph.setdefault(module, set()).update(deps - {module})
    return graph


def layer(module):
    return LAYERS[os.path.dirname(module)]


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_include_graph_has_no_cycle():
    graph = module_graph()
    assert "attention" in graph and "model" in graph
    assert find_cycle(graph) is None, f"include cycle: {' -> '.join(find_cycle(graph))}"


def test_includes_name_existing_files_from_the_root():
    for name in SOURCES:
        for inc in re.findall(r'#include "([^"]+)"', read(name)):
            assert os.path.exists(os.path.join(ROOT, inc)), f"{name} includes {inc}: not a path from the root"


def upward(graph):
    """The includes of graph that point up a layer (run.c, on top, may include anything)."""
    return [f"{m} includes {d}" for m, deps in graph.items() if m != "run" for d in deps if layer(d) > layer(m)]


def test_layers_include_downward_only():
    """kernels/ below the model (the top-level files), the model below serve/, run.c on
    top; the tokenizer needs only kernels/."""
    graph = module_graph()
    up = upward(graph)
    assert not up, "includes that point up: " + ", ".join(up)
    side = graph["tokenizer/spm_c"]
    assert all(layer(d) <= layer("tokenizer/spm_c") for d in side), side


def test_layer_rule_sees_an_upward_include():
    assert layer("kernels/kernels") < layer("model") < layer("serve/scheduler")
    assert layer("tokenizer/spm_c") < layer("model") and layer("kernels/utf8") < layer("tokenizer/spm_c")
    graph = {"run": {"serve/scheduler"}, "serve/scheduler": {"model"}, "model": {"kernels/kernels"},
             "kernels/kernels": set()}
    assert upward(graph) == []
    graph["kernels/kernels"] = {"model"}
    graph["model"] = {"kernels/kernels", "serve/scheduler"}
    assert sorted(upward(graph)) == ["kernels/kernels includes model", "model includes serve/scheduler"]


def test_top_level_is_the_model():
    """The top holds run.c and the files the posts are about; everything else is in a folder."""
    top = {f for f in SOURCES if "/" not in f}
    assert top <= {"run.c", "model.c", "model.h", "attention.c", "attention.h", "kvcache.c", "kvcache.h",
                   "kvtier.c", "kvtier.h", "loader.c", "loader.h", "config.h", "shape.c", "shape.h"}, top


def test_no_openmp_in_the_engine():
    """The threads are kernels/threads.c's team: no OpenMP region or runtime call anywhere."""
    for name in SOURCES:
        assert not re.search(r"#pragma omp|omp_[a-z_]+\(|<omp\.h>", read(name)), name


def test_comments_quote_no_timing_or_commit():
    bad = []
    for name in SOURCES:
        for comment in COMMENT.findall(read(name)):
            for pattern in (TIMING, COMMIT):
                m = pattern.search(comment)
                if m:
                    bad.append(f"{name}: {m.group(0)!r}")
    assert not bad, "measured figures belong in docs/PERFORMANCE.md: " + ", ".join(bad)


def test_patterns_catch_what_they_should():
    assert TIMING.search("took 0.51 ms per step") and TIMING.search("at 305 GFLOP/s")
    assert COMMIT.search("measured at 8c6b134") and not COMMIT.search("the 0xFFFF mask")


def test_readme_is_short():
    assert len(read("README.md").splitlines()) <= 150
