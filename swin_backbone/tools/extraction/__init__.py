"""The parts of ``swin-extract-features`` (:mod:`swin_backbone.tools.extract_features` parses the
command line and starts the run):

* :mod:`.inputs`: the images of INPUT and their output names;
* :mod:`.outputs`: one image's files, written whole, and the check that they are complete;
* :mod:`.pooled`: ``--pool avg``'s per-rank shards;
* :mod:`.loading`: decoding in DataLoader workers;
* :mod:`.distributed`, :mod:`.progress`: the torchrun job and its progress bar;
* :mod:`.rank`: one rank's loop (decode, batch, forward, write) and its record;
* :mod:`.settings`: the model, weights and preprocessing, and OUT_DIR's record of them;
* :mod:`.index`: rank 0's ``index.json`` / ``index.csv``;
* :mod:`.orchestration`: one run, from INPUT to the summary.
"""
