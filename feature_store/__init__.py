"""feature_store: stores traces and hidden states (Redis streams, local Arrow segments).

Knows nothing of models or Ray. Public API: StoreConfig; StoreWriter (servers: non-blocking put);
StoreReader / RecordFilter / Delivery / StoreStats (trainer: read, ack, stats); scan_records / StoreScan /
ScanResult (a read-only scan of a window: evaluation, export); store_config_from_options (the CLIs); codecs (CODECS,
get_codec, reconstruction_error); schema (encode_record, decode_record, SchemaVersionError);
export (export_parquet, export_jsonl). Submodules are imported on use, nothing runs at import time.
"""
