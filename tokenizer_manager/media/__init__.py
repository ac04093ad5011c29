"""Media: fetching, checking, decoding and preprocessing the images and videos a request names."""
