"""What a handler sees and how an app is loaded: no Spark, no AWS."""
