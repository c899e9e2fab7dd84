"""Views of a run drawn from its directory alone (metrics.jsonl, progress.json, summary.json):
curves.png (`curves.draw_curves`) and the sparklines of ``asyncrl status``. No torch; matplotlib
only when a picture is drawn."""
