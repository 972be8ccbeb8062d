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
// <options>). Each op is called through the dispatcher, as from Python, so the outputs equal
// the modules' bit for bit; what this saves is the Python between the ops (module calls,
// attribute lookups, views): a measurable share of a step at a few streams, where the
// kernels themselves take tens of microseconds.
//
// With many sequences of one decode token each (min_rows_per_thread a thread or more), each
// thread takes a contiguous share of them through every layer instead: no thread waits for
// the others at the end of every op, and a sequence's row gets the same result in its
// share as in the whole batch (the kernels' results do not depend on a row's neighbours).
// A speculative verification's rows attend to each other's new keys and values, stored
// within the same layer: they are never split.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

// A projection: its op, the arguments between x and the residual, and those after it.
struct BoundLinear {
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

c10::OperatorHandle find_op(const std::string& qualified_name) {
  const auto handle = c10::Dispatcher::singleton().findOp({qualified_name, ""});
  TORCH_CHECK(handle.has_value(), "no op named ", qualified_name);
  return *handle;
}

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
                                               const at::Tensor&, double, int64_t)>()) {}

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
    c10::OperatorHandle op = find_op(op_name);
    TORCH_CHECK(op.schema().arguments().size() == weight_args.size() + trailing_args.size() + 2,
                op_name, " takes ", op.schema().arguments().size(), " arguments");
    linears.push_back({std::move(op), std::move(weight_args), std::move(trailing_args)});
  }

  // The hidden states after the last layer, before the final norm; writes each layer's new
  // keys and values into its cache at slot_mapping. one_per_sequence: every row is a
  // sequence of its own (no row attends to another row's new key and value), so the rows
  // may go to the threads in shares.
  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 bool one_per_sequence) const {
    TORCH_CHECK(linears.size() == 4 * layers.size(), "a layer lacks its projections");
    TORCH_CHECK(kv_caches.size() == layers.size(), "one KV cache per layer");
    const int64_t tokens = h.size(0), threads = at::get_num_threads();
    if (!one_per_sequence || min_rows_per_thread == 0 || threads < 2 ||
        tokens < min_rows_per_thread * threads || at::in_parallel_region()) {
      return run_rows(h, cos, sin, kv_caches, slot_mapping, block_tables, seq_lens);
    }
    // One contiguous share of the sequences a thread, every layer of it on that thread
    // (the ops, called inside the parallel region, run on their caller's thread alone).
    std::vector<at::Tensor> shares(threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t share = begin; share < end; ++share) {
        const int64_t first = tokens * share / threads;
        const int64_t count = tokens * (share + 1) / threads - first;
        shares[share] = run_rows(h.narrow(0, first, count), cos.narrow(0, first, count),
                                 sin.narrow(0, first, count), kv_caches,
                                 slot_mapping.narrow(0, first, count),
                                 block_tables.narrow(0, first, count),
                                 seq_lens.narrow(0, first, count));
      }
    });
    return at::cat(shares);
  }

  // run's layers for the rows of h, each a decode token with its sequence's row of
  // block_tables, its context length (seq_lens), its slot and its rotary cos and sin.
  at::Tensor run_rows(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    const int64_t tokens = h.size(0), q_size = num_heads * head_dim;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      const BoundLinear* proj = linears.data() + 4 * i;
      const at::Tensor key_cache = kv_caches[i].select(0, 0);
      const at::Tensor value_cache = kv_caches[i].select(0, 1);
      const at::Tensor qkv = proj[0](rms_norm.call(h, layer.input_norm, eps), c10::nullopt);
      rotary_store_kv.call(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads,
                           num_kv_heads);
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
      const at::Tensor attended = decode_attention.call(q, key_cache, value_cache,
                                                        block_tables, seq_lens, scale,
                                                        window);
      h = proj[1](attended.view({tokens, q_size}), h);
      at::Tensor gated = proj[2](rms_norm.call(h, layer.post_norm, eps), c10::nullopt);
      if (layer.gate_after) gated = silu_and_mul.call(gated);
      h = proj[3](gated, h);
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<double, int64_t, int64_t, int64_t, double, int64_t, int64_t>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_linear", &DecodeLayers::add_linear)
      .def("run", &DecodeLayers::run);
}
