"""Developer tools, not part of the product (tools/README.md). Not installed: run them from the repository root."""
