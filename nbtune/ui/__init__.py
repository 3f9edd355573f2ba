"""Notebook side: matplotlib charts, the in-place live chart and the ipywidgets panel."""
