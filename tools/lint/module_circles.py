#!/usr/bin/env python3
"""Import circles among a crate's modules.

    tools/lint/module_circles.py SRC_DIR...

A file's `crate::x` and `super::x` paths are its imports (test modules left out). A folder counts
file by file (`engine/scheduler`, `family/mod` as `family`); elsewhere a top-level module is one
node. Prints each strongly connected set of two or more modules and exits 1 when there is one.
CI runs it on every crate (.ci/run)."""
import os
import re
import sys


def graph(root):
    folders = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))}
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            if parts[0] in ("lib", "main"):
                continue
            name = "/".join(parts[:2]) if parts[0] in folders and len(parts) > 1 else parts[0]
            if name.endswith("/mod"):
                name = name[: -len("/mod")]
            src = open(path, encoding="utf-8").read()
            src = re.sub(r"#\[cfg\(test\)\]\s*mod tests \{.*", "", src, flags=re.S)
            deps = set()

            def node(folder, sub):
                if sub and os.path.exists(os.path.join(root, folder, sub + ".rs")):
                    return folder + "/" + sub
                return folder

            for m in re.finditer(r"crate::(\w+)(?:::(\w+))?", src):
                deps.add(node(m.group(1), m.group(2)) if m.group(1) in folders else m.group(1))
            if parts[0] in folders and len(parts) == 2:
                for m in re.finditer(r"super::(\w+)", src):
                    deps.add(node(parts[0], m.group(1)))
            deps.discard(name)
            mods.setdefault(name, set()).update(deps)
    return mods


def circles(mods):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in mods.get(v, ()):
            if w not in mods:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in list(mods):
        if v not in index:
            visit(v)
    return found


def main():
    bad = False
    for root in sys.argv[1:]:
        for group in circles(graph(root)):
            print(f"{root}: modules import each other in a circle: {', '.join(group)}")
            bad = True
    if not bad:
        print(f"no import circles in {', '.join(sys.argv[1:])}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
