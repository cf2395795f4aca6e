"""The byte vocabulary shared by the data pipeline and the model.

Ids 0-255 are raw bytes. Two specials follow: SEP marks a document boundary in packed
sequences (it is placed before every document), PAD fills positions that carry no data
and is never a prediction target.
"""

SEP = 256
PAD = 257
VOCAB_SIZE = 258
