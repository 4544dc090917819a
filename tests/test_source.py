"""The source tree's own rules: the include graph has no cycle, OpenMP is used by
parallel.c only, code comments carry no measured timings or commit hashes (those
belong in docs/PERFORMANCE.md and commit messages), and README.md stays a short
user's page."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(f for f in os.listdir(ROOT) if f.endswith((".c", ".h", ".cc")))
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
TIMING = re.compile(r"\b\d+(\.\d+)?\s*(ms|us|µs|ns|GFLOP/s|GB/s|tokens/s)\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def module_graph():
    """module (file name without extension) -> the modules it includes"""
    graph = {}
    for name in SOURCES:
        module = os.path.splitext(name)[0]
        deps = {os.path.splitext(d)[0] for d in re.findall(r'#include "([^"]+)"', read(name))}
        graph.setdefault(module, set()).update(deps - {module})
    return graph


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


def test_layers_include_downward_only():
    """The kernels, threads and SIMD below never reach up to the model or attention."""
    graph = module_graph()
    for low in ("kernels", "parallel", "simd", "isa", "kvcache", "config"):
        for high in ("model", "attention", "loader", "run", "cli"):
            assert high not in graph[low], f"{low} includes {high}"


def test_openmp_only_in_parallel_c():
    for name in SOURCES:
        if name != "parallel.c":
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
