"""Chat formats: templates, reasoning channels, tool calls and constrained (structured) output."""
