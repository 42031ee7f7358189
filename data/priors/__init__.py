"""Prior families: structural causal models, random MLPs, random tree ensembles."""
