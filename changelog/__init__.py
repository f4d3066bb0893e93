"""Durability: changelog segments in S3, commit records in DynamoDB, restore and catch-up.

`changelog` builds on `state` and knows nothing of Spark or Kinesis.
"""
