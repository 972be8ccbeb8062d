// A Llama decoder stack's decode step in one call from Python: every layer's kernels in
// order, the same ops the layer modules call one by one, with the same arguments.
//
// Per layer, for T decode tokens (one each of T sequences), h the hidden states [T, H]:
//
//   qkv = qkv_proj(rms_norm(h, input_norm))           (the projection's own kernel)
//   rotary_store_kv(qkv, ...)                         (rotate q and k; k, v into the cache)
//   h   = o_proj(paged_decode_attention(q, ...)) + h  (the add in the projection's kernel)
//   h   = down_proj(silu_and_mul(gate_up_proj(rms_norm(h, post_norm)))) + h
//
// where the gate/up projection's kernel gates SiLU itself, silu_and_mul is not called.
//
// A projection is bound once (``add_linear``): its op's name and its arguments but x and
// the residual, in the order of every linear kernel's schema (x, <weight...>, residual,
// <options>); a weight packed in parts over runs of its rows (a GGUF file's Q4_K q and k
// beside a Q6_K v) binds one op a part (``add_linear_part``), their outputs side by side.
// Each op is called through the dispatcher, as from Python, so the outputs equal
// the modules' bit for bit; what this saves is the Python between the ops (module calls,
// attribute lookups, views): a measurable share of a step at a few streams, where the
// kernels themselves take tens of microseconds.
//
// With many sequences of one decode token each (min_rows_per_thread a thread or more), each
// thread takes a contiguous share of them through every layer instead: no thread waits for
// the others at the end of every op, and a sequence's row gets the same result in its
// share as in the whole batch (the kernels' results do not depend on a row's neighbours).
// A thread that finishes its rows early (its share attends over shorter contexts, or the
// other threads lost their cores to other programs for a while) waits for a piece: at its
// next layer boundary, a thread with rows to spare hands the second half of its rows over,
// with their hidden states, and each goes on from that layer (RowPieces). A speculative
// verification's rows attend to each other's new keys and values, stored within the same
// layer: they are never split.
//
// A batch with prompt tokens (run_mixed) takes the ops the layer modules call for it,
// NativeAttention's: the decode rows' attention on their own rows (index_select, then
// index_copy into the output) and one prefill attention call for the prompt rows (from an
// 8-bit cache, over the blocks the prompts' tables name, dequantized). Its rows never split
// between threads; each op spreads over them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace {

// An op bound to a projection's weight: its op, the arguments between x and the residual,
// and those after it.
struct BoundOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> weight_args, trailing_args;

  // x @ W.T (+ bias) (+ residual, where given), by the op.
  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& residual) const {
    torch::jit::Stack stack;
    stack.reserve(weight_args.size() + trailing_args.size() + 2);
    stack.emplace_back(x);
    stack.insert(stack.end(), weight_args.begin(), weight_args.end());
    stack.emplace_back(residual);
    stack.insert(stack.end(), trailing_args.begin(), trailing_args.end());
    op.callBoxed(&stack);
    return std::move(stack[0]).toTensor();
  }
};

// A projection: one op, or parts over runs of its output rows (a weight packed in parts,
// formats.StackedRowsWeight): their outputs side by side, then the residual added, as that
// class computes them.
struct BoundLinear {
  std::vector<BoundOp> parts;

  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& residual) const {
    if (parts.size() == 1) return parts[0](x, residual);
    std::vector<at::Tensor> outputs;
    outputs.reserve(parts.size());
    for (const BoundOp& part : parts) outputs.push_back(part(x, c10::nullopt));
    at::Tensor out = at::cat(outputs, 1);
    if (residual) out.add_(*residual);
    return out;
  }
};

c10::OperatorHandle find_op(const std::string& qualified_name) {
  const auto handle = c10::Dispatcher::singleton().findOp({qualified_name, ""});
  TORCH_CHECK(handle.has_value(), "no op named ", qualified_name);
  return *handle;
}

// op_name bound to its arguments but x and the residual, every one of its schema's given.
BoundOp bound_op(const std::string& op_name, std::vector<c10::IValue> weight_args,
                 std::vector<c10::IValue> trailing_args) {
  c10::OperatorHandle op = find_op(op_name);
  TORCH_CHECK(op.schema().arguments().size() == weight_args.size() + trailing_args.size() + 2,
              op_name, " takes ", op.schema().arguments().size(), " arguments");
  return {std::move(op), std::move(weight_args), std::move(trailing_args)};
}

// A layer's attention: (q [T, heads, D], the layer's KV cache [2, ...]) -> [T, heads * D].
using Attend = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// Rows [first, first + count) of a split call's batch at layer `layer`: their hidden states
// h entering it, and the rows' own rotary tables, slots, block tables and context lengths.
struct RowPiece {
  int64_t first = 0, count = 0, layer = 0;
  at::Tensor h, cos, sin, slot_mapping, block_tables, seq_lens;

  // The last `given` of these rows, at the same layer; these keep the others.
  RowPiece hand_over(int64_t given) {
    const int64_t kept = count - given;
    RowPiece other{first + kept, given, layer};
    at::Tensor RowPiece::*parts[] = {&RowPiece::h, &RowPiece::cos, &RowPiece::sin,
                                      &RowPiece::slot_mapping, &RowPiece::block_tables,
                                      &RowPiece::seq_lens};
    for (at::Tensor RowPiece::*part : parts) {
      other.*part = (this->*part).narrow(0, kept, given);
      this->*part = (this->*part).narrow(0, 0, kept);
    }
    count = kept;
    return other;
  }
};

// The pieces a split call's threads hand each other. Invariants: busy counts the threads
// computing rows; a piece is offered only while a thread waits (idle > 0), and at most one
// at a time; a thread leaves (next returns false) only when no thread is busy and no piece
// waits, so every row is computed once.
class RowPieces {
 public:
  // The calling thread starts on its share.
  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++busy_;
  }

  // Whether a thread waits for rows (cheap: read at every layer boundary).
  bool wanted() const { return idle_.load(std::memory_order_relaxed) > 0; }

  // Gives the last half of `from`'s rows to a waiting thread; false (from keeps them) if
  // none waits.
  bool offer(RowPiece& from) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (idle_.load(std::memory_order_relaxed) == 0 || has_offer_) return false;
    offered_ = from.hand_over(from.count / 2);
    has_offer_ = true;
    ++handovers_;
    ready_.notify_one();
    return true;
  }

  // The calling thread's rows are done: it waits, off its core, for a piece
  // (true: in piece) or for every thread to be done (false).
  bool next(RowPiece& piece) {
    std::unique_lock<std::mutex> lock(mutex_);
    --busy_;
    idle_.fetch_add(1, std::memory_order_relaxed);
    ready_.wait(lock, [&] { return has_offer_ || busy_ == 0; });
    idle_.fetch_sub(1, std::memory_order_relaxed);
    if (!has_offer_) {
      ready_.notify_all();
      return false;
    }
    piece = std::move(offered_);
    has_offer_ = false;
    ++busy_;
    return true;
  }

  // The calling thread failed: it stops being busy without waiting (nothing is offered to
  // it), so that the others still finish and leave.
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    --busy_;
    ready_.notify_all();
  }

  // A piece's rows are through the last layer: h, their hidden states.
  void finished(const RowPiece& piece) {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_.push_back(piece);
  }

  // The batch's hidden states, every piece's rows in place (called on the thread that
  // called the parallel region, once every thread has left: an in-place copy on a worker
  // thread would not be in the caller's inference mode).
  at::Tensor gather(const at::Tensor& like) const {
    at::Tensor out = at::empty_like(like);
    for (const RowPiece& piece : finished_) out.narrow(0, piece.first, piece.count).copy_(piece.h);
    return out;
  }

  int64_t handovers() const { return handovers_; }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::atomic<int64_t> idle_{0};
  int64_t busy_ = 0, handovers_ = 0;
  bool has_offer_ = false;
  RowPiece offered_;
  std::vector<RowPiece> finished_;
};

// A piece is handed over only with this many rows or more (each half then keeps at least
// half of them) and two layers or more to go: fewer rows a matmul read the weights for
// fewer products each, and the last layer alone is not worth a second read of its weights.
constexpr int64_t kMinRowsToHandOver = 8;
constexpr int64_t kMinLayersToHandOver = 2;

struct DecodeLayers : torch::CustomClassHolder {
  struct Layer {
    at::Tensor input_norm, post_norm;
    bool gate_after;  // silu_and_mul after the gate/up projection (its kernel does not gate)
  };

  double eps, scale;
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t window;  // the decode attention's, every layer's: 0 is none
  // decode tokens a thread needs before run gives each thread a share of the sequences
  // (each thread then reads every weight itself); 0: never
  int64_t min_rows_per_thread;
  // pieces handed from one thread to another, over all calls
  mutable std::atomic<int64_t> handovers{0};
  std::vector<Layer> layers;
  std::vector<BoundLinear> linears;  // qkv, o, gate_up, down of each layer in turn
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor,
                                at::Tensor, const at::Tensor&, int64_t, int64_t)>
      rotary_store_kv;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, int64_t)>
      decode_attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>
      dequantize_kv_blocks;
  // (only in builds for CPUs with AVX512-BF16)
  c10::optional<c10::TypedOperatorHandle<void(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, double, at::Tensor)>>
      prefill_attention;

  DecodeLayers(double eps_, int64_t num_heads_, int64_t num_kv_heads_, int64_t head_dim_,
               double scale_, int64_t window_, int64_t min_rows_per_thread_)
      : eps(eps_), scale(scale_), num_heads(num_heads_), num_kv_heads(num_kv_heads_),
        head_dim(head_dim_), window(window_), min_rows_per_thread(min_rows_per_thread_),
        rms_norm(find_op("tokenmill::rms_norm")
                     .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>()),
        silu_and_mul(find_op("tokenmill::silu_and_mul").typed<at::Tensor(const at::Tensor&)>()),
        rotary_store_kv(
            find_op("tokenmill::rotary_store_kv")
                .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor,
                            at::Tensor, const at::Tensor&, int64_t, int64_t)>()),
        decode_attention(find_op("tokenmill::paged_decode_attention")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, int64_t)>()),
        dequantize_kv_blocks(
            find_op("tokenmill::dequantize_kv_blocks")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>()) {
    const auto prefill =
        c10::Dispatcher::singleton().findOp({"tokenmill::paged_prefill_attention", ""});
    if (prefill.has_value()) {
      prefill_attention = prefill->typed<void(const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, double,
                                              at::Tensor)>();
    }
  }

  // The next layer's norms' weights and whether silu_and_mul follows its gate/up
  // projection; its projections follow by add_linear, four of them.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, bool gate_after) {
    TORCH_CHECK(linears.size() == 4 * layers.size(), "each layer takes four projections");
    layers.push_back({std::move(input_norm), std::move(post_norm), gate_after});
  }

  // A projection of the last layer added: op_name(x, *weight_args, residual,
  // *trailing_args), every argument of the op's schema given.
  void add_linear(const std::string& op_name, std::vector<c10::IValue> weight_args,
                  std::vector<c10::IValue> trailing_args) {
    TORCH_CHECK(linears.size() < 4 * layers.size(), "add_layer before its projections");
    linears.push_back({{bound_op(op_name, std::move(weight_args), std::move(trailing_args))}});
  }

  // The next part of the last projection added (its next run of output rows), bound as
  // add_linear binds one.
  void add_linear_part(const std::string& op_name, std::vector<c10::IValue> weight_args,
                       std::vector<c10::IValue> trailing_args) {
    TORCH_CHECK(linears.size() > 4 * (layers.size() - 1) && !layers.empty(),
                "add_linear before the parts that follow it");
    linears.back().parts.push_back(
        bound_op(op_name, std::move(weight_args), std::move(trailing_args)));
  }

  // The hidden states after the last layer, before the final norm; writes each layer's new
  // keys and values into its cache at slot_mapping. one_per_sequence: every row is a
  // sequence of its own (no row attends to another row's new key and value), so the rows
  // may go to the threads in shares.
  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 bool one_per_sequence) const {
    check_stack(kv_caches);
    const int64_t tokens = h.size(0), threads = at::get_num_threads();
    if (!one_per_sequence || min_rows_per_thread == 0 || threads < 2 ||
        tokens < min_rows_per_thread * threads || at::in_parallel_region()) {
      return run_rows(h, cos, sin, kv_caches, slot_mapping, block_tables, seq_lens);
    }
    // One contiguous share of the sequences a thread, every layer of it on that thread
    // (the ops, called inside the parallel region, run on their caller's thread alone),
    // and then the pieces other threads hand over.
    RowPieces pieces;
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t share = begin; share < end; ++share) {
        const int64_t first = tokens * share / threads;
        const int64_t count = tokens * (share + 1) / threads - first;
        RowPiece piece{first, count, 0, h.narrow(0, first, count),
                       cos.narrow(0, first, count), sin.narrow(0, first, count),
                       slot_mapping.narrow(0, first, count),
                       block_tables.narrow(0, first, count), seq_lens.narrow(0, first, count)};
        pieces.start();
        do {
          try {
            run_piece(piece, kv_caches, pieces);
          } catch (...) {
            pieces.leave();
            throw;
          }
        } while (pieces.next(piece));
      }
    });
    handovers += pieces.handovers();
    return pieces.gather(h);
  }

  // How many pieces threads have handed over, over every call so far.
  int64_t handover_count() const { return handovers.load(); }

  // piece's rows from its layer through the last (then pieces.finished); at each layer
  // boundary, the second half of them to a thread that waits for rows, where worth it.
  void run_piece(RowPiece& piece, const std::vector<at::Tensor>& kv_caches,
                 RowPieces& pieces) const {
    const int64_t last = static_cast<int64_t>(layers.size());
    for (; piece.layer < last; ++piece.layer) {
      if (pieces.wanted() && piece.count >= kMinRowsToHandOver &&
          last - piece.layer >= kMinLayersToHandOver) {
        pieces.offer(piece);
      }
      piece.h = run_layer(piece.layer, piece.h, piece.cos, piece.sin, kv_caches,
                          piece.slot_mapping, decodes(piece.block_tables, piece.seq_lens));
    }
    pieces.finished(piece);
  }

  // run's layers for the rows of h, each a decode token with its sequence's row of
  // block_tables, its context length (seq_lens), its slot and its rotary cos and sin.
  at::Tensor run_rows(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    return run_all(h, cos, sin, kv_caches, slot_mapping, decodes(block_tables, seq_lens));
  }

  // run's layers for a batch with prompt rows (rows, cos, sin, caches and slots as run_rows
  // takes them): the decode rows are decode_rows (flat rows; none without decode rows), with
  // their block tables and context lengths; the prompts', as NativePrefill plans them,
  // prefill_tables with query_ranges ([start, end) of their rows) and context lengths,
  // and for an 8-bit cache the blocks the tables name (ascending) and the tables renumbered
  // into them.
  at::Tensor run_mixed(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                       const c10::optional<at::Tensor>& decode_rows,
                       const c10::optional<at::Tensor>& decode_tables,
                       const c10::optional<at::Tensor>& decode_lens,
                       const at::Tensor& prefill_tables, const at::Tensor& query_ranges,
                       const at::Tensor& prefill_lens, const at::Tensor& blocks,
                       const at::Tensor& renumbered) const {
    check_stack(kv_caches);
    TORCH_CHECK(prefill_attention.has_value(), "these kernels have no paged_prefill_attention");
    TORCH_CHECK(decode_rows.has_value() == decode_tables.has_value() &&
                    decode_rows.has_value() == decode_lens.has_value(),
                "decode rows come with their block tables and context lengths");
    const int64_t q_size = num_heads * head_dim;
    const Attend attend = [&](const at::Tensor& q, const at::Tensor& kv_cache) {
      at::Tensor out = at::empty({q.size(0), q_size}, q.options());
      if (decode_rows.has_value()) {
        const at::Tensor decoded =
            decode_attention.call(q.index_select(0, *decode_rows), kv_cache.select(0, 0),
                                  kv_cache.select(0, 1), *decode_tables, *decode_lens, scale,
                                  window);
        out.index_copy_(0, *decode_rows, decoded.view({decoded.size(0), q_size}));
      }
      const bool int8_cache = kv_cache.scalar_type() == at::kChar;
      const at::Tensor read =
          int8_cache ? dequantize_kv_blocks.call(kv_cache, blocks, q.scalar_type()) : kv_cache;
      prefill_attention->call(q, read.select(0, 0), read.select(0, 1),
                              int8_cache ? renumbered : prefill_tables, query_ranges,
                              prefill_lens, scale, out);
      return out;
    };
    return run_all(h, cos, sin, kv_caches, slot_mapping, attend);
  }

  // Every layer has its four projections, and kv_caches one cache a layer.
  void check_stack(const std::vector<at::Tensor>& kv_caches) const {
    TORCH_CHECK(linears.size() == 4 * layers.size(), "a layer lacks its projections");
    TORCH_CHECK(kv_caches.size() == layers.size(), "one KV cache per layer");
  }

  // Every layer for the rows of h, attention by `attend`.
  at::Tensor run_all(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const Attend& attend) const {
    for (int64_t i = 0; i < static_cast<int64_t>(layers.size()); ++i) {
      h = run_layer(i, h, cos, sin, kv_caches, slot_mapping, attend);
    }
    return h;
  }

  // The attention of rows that are each a decode token (of its own sequence, or of a
  // speculative verification's), with its row of block_tables and its context length.
  Attend decodes(const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    return [this, &block_tables, &seq_lens](const at::Tensor& q, const at::Tensor& kv_cache) {
      const at::Tensor out = decode_attention.call(q, kv_cache.select(0, 0),
                                                   kv_cache.select(0, 1), block_tables,
                                                   seq_lens, scale, window);
      return out.view({q.size(0), num_heads * head_dim});
    };
  }

  // Layer i for the rows of h (as run_rows), attention by `attend`.
  at::Tensor run_layer(int64_t i, const at::Tensor& h, const at::Tensor& cos,
                       const at::Tensor& sin, const std::vector<at::Tensor>& kv_caches,
                       const at::Tensor& slot_mapping, const Attend& attend) const {
    const int64_t tokens = h.size(0), q_size = num_heads * head_dim;
    const Layer& layer = layers[i];
    const BoundLinear* proj = linears.data() + 4 * i;
    const at::Tensor key_cache = kv_caches[i].select(0, 0);
    const at::Tensor value_cache = kv_caches[i].select(0, 1);
    const at::Tensor qkv = proj[0](rms_norm.call(h, layer.input_norm, eps), c10::nullopt);
    rotary_store_kv.call(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads,
                         num_kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor attended_h = proj[1](attend(q, kv_caches[i]), h);
    at::Tensor gated = proj[2](rms_norm.call(attended_h, layer.post_norm, eps), c10::nullopt);
    if (layer.gate_after) gated = silu_and_mul.call(gated);
    return proj[3](gated, attended_h);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<double, int64_t, int64_t, int64_t, double, int64_t, int64_t>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_linear", &DecodeLayers::add_linear)
      .def("add_linear_part", &DecodeLayers::add_linear_part)
      .def("run", &DecodeLayers::run)
      .def("run_mixed", &DecodeLayers::run_mixed)
      .def("handover_count", &DecodeLayers::handover_count);
}
