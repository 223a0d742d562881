"""Reporting: formatted tables (``format``), targets and their ratios (``targets``), RESULTS.md
(``results_md``)."""
