"""Pure figure builders: small, already-aggregated DataFrames in, Plotly figures (or their plain specs) out."""
