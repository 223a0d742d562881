"""The parts of ``benchmarks/bench.py``, one job per module (imports only go down).

::

    bench.py            entry point: arguments, environment, main
    runner.py           runs each (scenario, contender) in a fresh child with the servers it needs
    plot.py             the figure (matplotlib)
    report/             formatting (tables, ratios), targets, RESULTS.md
    scenarios/          one module per scenario family: its plan, its measurement, its table
    contenders/         the ways of reading an epoch: ours, the alternatives, the limits
    measure.py, rss.py  timing of an epoch; memory sampling
    isolation.py        a task in a forked child with its own process group and a timeout
    processes.py        helper processes and worker servers that die with their parent

``scenarios/frontends.py`` and ``contenders/frontends.py`` are ``bench_frontends.py``'s (the front
ends without DataLoader2, in the torchdata >= 0.10 environment): not in the registries of this run.

A new table (such as distribution policies and one slow worker, the worker-side cache, or
scaling to many sessions) is a new module in ``scenarios/`` listed in
``scenarios/__init__.py``, plus its contenders in ``contenders/`` if it needs new ones and its
targets in ``report/targets.py``.
"""
