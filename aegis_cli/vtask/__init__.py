"""vTasks: the smallest replayable context of a flagged computation. ``model`` (the data
types and limits), ``manifest`` (the JSON manifest and its validation), ``bundle`` (the file
format, reader and writer), ``capture`` (tensors plus provenance → a vTask), ``replay``
(bundles → a replay report on any device). docs/bundle-format.md is the format's spec."""
