//! The restore of a snapshot's memory image with and without its per-extent
//! checks: the same extents copied into fresh memory, once checking each
//! one's CRC-32 (`memory_image::load`, what `kemari --restore` does) and
//! once not, alternated, with every page of guest memory in use (the worst
//! case for the checks) and the image in the page cache (so that the disk
//! does not hide their cost).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::persist::{image_index, memory_image};

use crate::report::{Report, Table};
use serde_json::json;

/// `kemari-bench memory-image`.
#[derive(Debug, clap::Args)]
pub struct MemoryImageArgs {
    /// Guest memory sizes.
    #[arg(long, value_delimiter = ',', default_values = ["256M", "1G"])]
    pub memory: Vec<String>,
    /// Restores measured per size and kind (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// Directory for the images (a disk, not tmpfs).
    #[arg(long, default_value = "/var/tmp")]
    pub work_dir: PathBuf,
}

/// Why the measurement could not be made.
#[derive(Debug, thiserror::Error)]
pub enum MemoryImageError {
    /// A size that does not parse.
    #[error(transparent)]
    Size(#[from] vmm::config::ConfigError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] vmm::memory::MemoryError),
    /// The image.
    #[error(transparent)]
    Image(#[from] memory_image::ImageError),
    /// The index the save wrote does not read back.
    #[error("index {0}")]
    Index(#[from] image_index::IndexError),
    /// File I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &std::path::Path) -> impl Fn(std::io::Error) -> MemoryImageError + '_ {
    move |source| MemoryImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Extents, then the unchecked, checked and CRC-alone times of every run.
type Measured = (usize, Vec<Duration>, Vec<Duration>, Vec<Duration>);

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Writes a full image per size, then times checked and unchecked restores.
pub fn run(args: &MemoryImageArgs, report: &mut Report) -> Result<(), MemoryImageError> {
    report.param("memory", args.memory.clone());
    report.param("runs", args.runs.max(1));
    let mut table = Table::new(
        format!(
            "memory image restore, every page in use, image in the page cache, ms (median of {} runs)",
            args.runs.max(1)
        ),
        &["memory", "extents", "unchecked", "checked", "checked/unchecked", "CRC-32 alone"],
    );
    println!(
        "memory image restore, every page in use, image in the page cache: median of {} runs, ms",
        args.runs.max(1)
    );
    println!("  memory    extents   unchecked     checked   checked/unchecked   CRC-32 alone");
    for text in &args.memory {
        let size = vmm::config::parse_size(text)?;
        let dir = args
            .work_dir
            .join(format!("kemari-bench-image-{}-{text}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let (image, index) = (dir.join("memory.bin"), dir.join("memory.extents"));
        let result = measure(size, &image, &index, args.runs.max(1));
        let _ = std::fs::remove_dir_all(&dir);
        let (extents, plain, checked, crc) = result?;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let all = |v: &[Duration]| v.iter().map(|d| ms(*d)).collect::<Vec<_>>();
        report.run(json!({
            "memory": text,
            "extents": extents,
            "unchecked_ms": all(&plain),
            "checked_ms": all(&checked),
            "crc_ms": all(&crc),
        }));
        let (plain, checked, crc) = (median(plain), median(checked), median(crc));
        table.row(vec![
            text.as_str().into(),
            extents.into(),
            ms(plain).into(),
            ms(checked).into(),
            (checked.as_secs_f64() / plain.as_secs_f64()).into(),
            ms(crc).into(),
        ]);
        println!(
            "  {text:>6} {extents:>10} {:>11.1} {:>11.1} {:>18.3} {:>14.1}",
            ms(plain),
            ms(checked),
            checked.as_secs_f64() / plain.as_secs_f64(),
            ms(crc)
        );
    }
    report.table(table);
    Ok(())
}

fn measure(
    size: u64,
    image: &std::path::Path,
    index: &std::path::Path,
    runs: usize,
) -> Result<Measured, MemoryImageError> {
    let mem = GuestMemoryFile::create(size, &MemoryBacking::Memfd)?;
    // Every page different and non-zero.
    let mut chunk = vec![0u8; 1 << 20];
    for (i, at) in (0..size).step_by(chunk.len()).enumerate() {
        for (j, b) in chunk.iter_mut().enumerate() {
            *b = (i ^ j) as u8 | 1;
        }
        mem.file().write_all_at(&chunk, at).map_err(io(image))?;
    }
    memory_image::save(&mem, image, index)?;
    drop(mem);
    let extents = image_index::decode(&std::fs::read(index).map_err(io(index))?, size)?;
    let file = std::fs::File::open(image).map_err(io(image))?;
    let (mut plain, mut checked) = (Vec::new(), Vec::new());
    // Alternated, each kind first every other run: freeing the previous
    // copy's pages costs the next one.
    for run in 0..runs * 2 {
        let t = Instant::now();
        if (run % 2 == 0) == (run / 2 % 2 == 0) {
            // As load does: the file opened afresh, the memory created.
            let file = std::fs::File::open(image).map_err(io(image))?;
            let mem = GuestMemoryFile::create(size, &MemoryBacking::Memfd)?;
            for e in &extents {
                let data = &mut chunk[..e.len as usize];
                file.read_exact_at(data, e.offset).map_err(io(image))?;
                mem.file().write_all_at(data, e.offset).map_err(io(image))?;
            }
            plain.push(t.elapsed());
        } else {
            let mem = memory_image::load(image, index, size, &MemoryBacking::Memfd)?;
            checked.push(t.elapsed());
            drop(mem);
        }
    }
    // What the checks add: each extent hashed once, just read (as in load).
    let mut crc = Vec::new();
    for _ in 0..runs {
        let mut spent = Duration::ZERO;
        for e in &extents {
            let data = &mut chunk[..e.len as usize];
            file.read_exact_at(data, e.offset).map_err(io(image))?;
            let t = Instant::now();
            std::hint::black_box(crc32fast::hash(data));
            spent += t.elapsed();
        }
        crc.push(spent);
    }
    Ok((extents.len(), plain, checked, crc))
}
