"""Figures and the HTML report of a run directory; imports no torch and no training code.

Entry points: `rldynamics.plots.cli.plot_command` / `report_command` (`rldyn plot`, `rldyn report`);
`rldynamics.plots.report.write_report`; per-step figures in `analysis`, curves in `curves`, the health monitor's
events on a timeline and the run's verdict in `timeline`, the glossary of its rules and signals in `glossary`, the
post-run checks over the metrics in `health`.
"""
