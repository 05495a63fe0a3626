"""Strips and widgets the pages draw (Streamlit calls only, data from `queries/`, figures from `figures/`)."""
