"""The HTTP APIs, one module per API: each turns its request into a `GenerateInput` (the one
internal request type) and the outputs back into its response or stream (see `base.Serving`)."""
