"""No import cycle between any two modules of the workspace's five packages (module level, not only packages).

Imports under `if TYPE_CHECKING:` are left out (they never run); function-level imports count.
"""

from __future__ import annotations

import grimp

ROOTS = ("deepinfer_engine", "deepinfer_kernels", "deepinfer_parallel", "deepinfer_dspark", "deepseek_recipe")


def find_cycle(graph: object, modules: set[str]) -> list[str] | None:
    """One import cycle among `modules` as [m0, m1, ..., m0], or None (iterative DFS, white / grey / black)."""
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    for root in sorted(modules):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            nxt = next(children, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt) & modules))))
    return None


def test_find_cycle_names_a_cycle() -> None:
    class Graph:
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return self.edges[m]

    assert find_cycle(Graph(), {"a", "b", "c", "d"}) == ["a", "b", "c", "a"]
    Graph.edges["c"] = set()
    assert find_cycle(Graph(), {"a", "b", "c", "d"}) is None


def test_no_import_cycle_between_modules() -> None:
    graph = grimp.build_graph(*ROOTS, exclude_type_checking_imports=True)
    modules = {m for m in graph.modules if m.split(".")[0] in ROOTS}
    cycle = find_cycle(graph, modules)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
