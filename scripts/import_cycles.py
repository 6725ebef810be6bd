#!/usr/bin/env python3
"""Import circles among a crate's modules: `python3 scripts/import_cycles.py CRATE_SRC [PREFIX]`.

Each module file's `crate::...` and `super::...` paths (outside `#[cfg(test)]` modules and `*tests.rs` files) are
resolved to the module file they name; a circle is a strongly connected group of two or more files. PREFIX limits
the report to circles among files under it (e.g. `serve/`). Prints the circles and exits 1 when there is one.
"""
import os
import re
import sys


def module_files(src):
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f.endswith("tests.rs"):
                continue
            path = os.path.relpath(os.path.join(root, f), src)
            parts = path[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            out[tuple(parts)] = path
    return out


def strip_tests(text):
    # Drops `#[cfg(test)] mod x { ... }` bodies (brace-matched).
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    text = "".join(out)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def resolve(mods, segs):
    # The longest prefix of `segs` that is a module file.
    for n in range(len(segs), -1, -1):
        if tuple(segs[:n]) in mods:
            return tuple(segs[:n])
    return None


def edges(src, mods):
    g = {m: set() for m in mods}
    for m, path in mods.items():
        text = strip_tests(open(os.path.join(src, path), encoding="utf-8").read())
        is_dir_mod = os.path.basename(path) in ("mod.rs", "lib.rs", "main.rs")
        # `use a::{b, c::d}` groups are flattened one level.
        paths = []
        for u in re.finditer(r"\b(crate|super)((?:::\w+)+)(::\{([^}]*)\})?", text):
            base = [u.group(1)] + u.group(2).strip(":").split("::")
            if u.group(4):
                for item in u.group(4).split(","):
                    item = item.strip().split(" as ")[0]
                    if item and item != "self":
                        paths.append(base + [s for s in item.split("::") if s and s != "{"])
                    else:
                        paths.append(base)
            else:
                paths.append(base)
        for p in paths:
            if p[0] == "crate":
                segs = p[1:]
            else:
                parent = list(m) if is_dir_mod else list(m[:-1])
                while p and p[0] == "super":
                    p = p[1:]
                    parent = parent[:-1] if not is_dir_mod else parent[:-1]
                segs = parent + p if p else parent
            t = resolve(mods, segs)
            if t is not None and t != m and t != ():
                g[m].add(t)
    return g


def sccs(g):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def main():
    src = sys.argv[1]
    prefix = tuple(sys.argv[2].strip("/").split("/")) if len(sys.argv) > 2 else ()
    mods = module_files(src)
    g = edges(src, mods)
    if prefix:
        keep = {m for m in g if m[: len(prefix)] == prefix}
        g = {m: {t for t in ts if t in keep} for m, ts in g.items() if m in keep}
    bad = sccs(g)
    for comp in bad:
        print("circle:", " <-> ".join("/".join(c) for c in sorted(comp)))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
