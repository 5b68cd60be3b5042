//! The storage layout: every object key the service writes, in one place.
//!
//! - `files/<id>`: an uploaded file's bytes.
//! - `results/<batch>/<epoch>/<file>`: a batch's result files, per lease epoch, so a fenced
//!   replica's late upload lands beside the holder's, never on it.
//! - `checkpoints/<batch>/<epoch>/<file>`: a running job's checkpointed result files, per epoch.
//! - under [`STATE_PREFIX`], the copy of Redis's records Redis is rebuilt from
//!   (see [`Store::rebuild`](crate::Store::rebuild)):
//!   - `state/files/<id>.json`: the [`StoredFile`](crate::StoredFile);
//!   - `state/batches/<id>.json`: `{"epoch": n, "record": StoredBatch}`, `n` the lease epoch of
//!     the write (0: unfenced);
//!   - `state/cancels/<id>`: the Unix second a cancel was asked (gone once the batch ended);
//!   - `state/checkpoints/<id>.json`: the job's latest checkpoint record.

/// The storage folder of the records' copy.
pub const STATE_PREFIX: &str = "state";

/// The key of uploaded file `id`'s bytes.
pub fn upload(id: &str) -> String {
    format!("files/{id}")
}

/// The key of batch `batch`'s result file `file` (`output.jsonl`, `error.jsonl`) written under
/// lease epoch `epoch`.
pub fn result(batch: &str, epoch: u64, file: &str) -> String {
    format!("results/{batch}/{epoch}/{file}")
}

/// The folder of every checkpoint of batch `batch`.
pub fn checkpoints(batch: &str) -> String {
    format!("checkpoints/{batch}")
}

/// The key of result file `file` of batch `batch`'s checkpoint under lease epoch `epoch`.
pub fn checkpoint(batch: &str, epoch: u64, file: &str) -> String {
    format!("{}/{epoch}/{file}", checkpoints(batch))
}

/// The folder of the file records' copies.
pub fn file_copies() -> String {
    format!("{STATE_PREFIX}/files")
}

/// The folder of the batch records' copies.
pub fn batch_copies() -> String {
    format!("{STATE_PREFIX}/batches")
}

/// The key of file `id`'s record copy.
pub fn file_copy(id: &str) -> String {
    format!("{}/{id}.json", file_copies())
}

/// The key of batch `id`'s record copy.
pub fn batch_copy(id: &str) -> String {
    format!("{}/{id}.json", batch_copies())
}

/// The key of batch `id`'s cancel request copy.
pub fn cancel_copy(id: &str) -> String {
    format!("{STATE_PREFIX}/cancels/{id}")
}

/// The key of batch `id`'s checkpoint record copy.
pub fn checkpoint_copy(id: &str) -> String {
    format!("{STATE_PREFIX}/checkpoints/{id}.json")
}

/// The id in a record copy's key `state/<kind>/<id>[.json]`.
pub fn id_of_copy(key: &str) -> &str {
    let name = key.rsplit('/').next().unwrap_or(key);
    name.strip_suffix(".json").unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_their_layout() {
        assert_eq!(upload("file-1"), "files/file-1");
        assert_eq!(
            result("batch_1", 3, "output.jsonl"),
            "results/batch_1/3/output.jsonl"
        );
        assert_eq!(
            checkpoint("batch_1", 2, "error.jsonl"),
            "checkpoints/batch_1/2/error.jsonl"
        );
        assert_eq!(batch_copy("batch_1"), "state/batches/batch_1.json");
        assert_eq!(id_of_copy(&batch_copy("batch_1")), "batch_1");
        assert_eq!(id_of_copy(&cancel_copy("batch_1")), "batch_1");
    }
}
