"""The part of cuDNN's C API that chainer_tc calls: prototypes, the enum values it passes, the
algorithm result structure. Data only; ``chainer_tc.cuda.cudnn`` binds and calls it.

Written against the declarations of cuDNN 8.9.7 (``cudnn_*_v8.h``, the ``nvidia-cudnn-cu12``
8.9.7.29 wheel) and checked against cuDNN 9's (``cudnn_*_v9.h``, ``nvidia-cudnn-cu13`` 9.24): the
legacy calls below keep their prototypes, enum values and result structure in 9 (marked
deprecated there, still exported by ``libcudnn.so.9``); the status codes differ (9 renumbered
them), so nothing here compares a status with anything but CUDNN_STATUS_SUCCESS (0).
``tests/test_cuda_cudnn.py`` checks every line here against both sets of headers.

C types map to ctypes as: handles, descriptors, data and output pointers -> ``c_void_p`` (an
output is passed as the address of a ctypes object), enums and ints -> ``c_int``, ``size_t`` ->
``c_size_t``, ``double`` -> ``c_double``. Every function returns ``cudnnStatus_t``.
"""
import ctypes

_ptr, _int, _size, _double = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double

# ---- enum values (the same in cuDNN 8.9 and 9) -------------------------------------------------
CUDNN_DATA_FLOAT, CUDNN_DATA_DOUBLE, CUDNN_DATA_HALF = 0, 1, 2              # cudnnDataType_t
CUDNN_TENSOR_NCHW, CUDNN_TENSOR_NHWC = 0, 1                                # cudnnTensorFormat_t
CUDNN_CROSS_CORRELATION = 1                                                # cudnnConvolutionMode_t
CUDNN_DEFAULT_MATH, CUDNN_TENSOR_OP_MATH = 0, 1                            # cudnnMathType_t
CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION = 2
CUDNN_ACTIVATION_RELU = 1                                                  # cudnnActivationMode_t
CUDNN_NOT_PROPAGATE_NAN, CUDNN_PROPAGATE_NAN = 0, 1                        # cudnnNanPropagation_t
CUDNN_BATCHNORM_PER_ACTIVATION, CUDNN_BATCHNORM_SPATIAL = 0, 1             # cudnnBatchNormMode_t
CUDNN_BATCHNORM_SPATIAL_PERSISTENT = 2
CUDNN_BATCHNORM_OPS_BN = 0                                                 # cudnnBatchNormOps_t
CUDNN_BATCHNORM_OPS_BN_ACTIVATION = 1
CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION = 2
CUDNN_BN_MIN_EPSILON = 0.0                                                 # a #define
CUDNN_SOFTMAX_MODE_INSTANCE, CUDNN_SOFTMAX_MODE_CHANNEL = 0, 1             # cudnnSoftmaxMode_t
CUDNN_POOLING_MAX = 0                                                      # cudnnPoolingMode_t

ENUMS = {name: value for name, value in globals().items() if name.startswith('CUDNN_')}


class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: one layout for the three."""
    _fields_ = [('algo', ctypes.c_int), ('status', ctypes.c_int), ('time', ctypes.c_float),
                ('memory', ctypes.c_size_t), ('determinism', ctypes.c_int),
                ('mathType', ctypes.c_int), ('reserved', ctypes.c_int * 3)]


def _conv(a, a_data, b, b_data, out, out_data):
    """The three convolution calls: operands named as in the C header."""
    return (('handle', _ptr), ('alpha', _ptr), (a, _ptr), (a_data, _ptr), (b, _ptr),
            (b_data, _ptr), ('convDesc', _ptr), ('algo', _int), ('workSpace', _ptr),
            ('workSpaceSizeInBytes', _size), ('beta', _ptr), (out, _ptr), (out_data, _ptr))


def _get_algorithm(a, b, out):
    """cudnnGetConvolution*Algorithm_v7: cuDNN's heuristics, ranked."""
    return (('handle', _ptr), (a, _ptr), (b, _ptr), ('convDesc', _ptr), (out, _ptr),
            ('requestedAlgoCount', _int), ('returnedAlgoCount', _ptr), ('perfResults', _ptr))


def _find_algorithm(a, a_data, b, b_data, out, out_data):
    """cudnnFindConvolution*AlgorithmEx: every algorithm run and timed, ranked."""
    return (('handle', _ptr), (a, _ptr), (a_data, _ptr), (b, _ptr), (b_data, _ptr),
            ('convDesc', _ptr), (out, _ptr), (out_data, _ptr), ('requestedAlgoCount', _int),
            ('returnedAlgoCount', _ptr), ('perfResults', _ptr), ('workSpace', _ptr),
            ('workSpaceSizeInBytes', _size))


def _workspace_size(a, b, out):
    return (('handle', _ptr), (a, _ptr), (b, _ptr), ('convDesc', _ptr), (out, _ptr),
            ('algo', _int), ('sizeInBytes', _ptr))


def _create(name):
    return (('{}Desc'.format(name), _ptr),)


# C name -> ((parameter name, ctypes type), ...), in the order of the C prototype.
PROTOTYPES = {
    # the handle and its stream
    'cudnnCreate': (('handle', _ptr),),
    'cudnnDestroy': (('handle', _ptr),),
    'cudnnSetStream': (('handle', _ptr), ('streamId', _ptr)),
    # descriptors (host-only calls: no GPU needed)
    'cudnnCreateTensorDescriptor': _create('tensor'),
    'cudnnDestroyTensorDescriptor': _create('tensor'),
    'cudnnSetTensor4dDescriptor': (('tensorDesc', _ptr), ('format', _int), ('dataType', _int),
                                   ('n', _int), ('c', _int), ('h', _int), ('w', _int)),
    'cudnnCreateFilterDescriptor': _create('filter'),
    'cudnnDestroyFilterDescriptor': _create('filter'),
    'cudnnSetFilter4dDescriptor': (('filterDesc', _ptr), ('dataType', _int), ('format', _int),
                                   ('k', _int), ('c', _int), ('h', _int), ('w', _int)),
    'cudnnCreateConvolutionDescriptor': _create('conv'),
    'cudnnDestroyConvolutionDescriptor': _create('conv'),
    'cudnnSetConvolution2dDescriptor': (
        ('convDesc', _ptr), ('pad_h', _int), ('pad_w', _int), ('u', _int), ('v', _int),
        ('dilation_h', _int), ('dilation_w', _int), ('mode', _int), ('computeType', _int)),
    'cudnnSetConvolutionGroupCount': (('convDesc', _ptr), ('groupCount', _int)),
    'cudnnSetConvolutionMathType': (('convDesc', _ptr), ('mathType', _int)),
    'cudnnCreateActivationDescriptor': _create('activation'),
    'cudnnDestroyActivationDescriptor': _create('activation'),
    'cudnnSetActivationDescriptor': (('activationDesc', _ptr), ('mode', _int),
                                     ('reluNanOpt', _int), ('coef', _double)),
    'cudnnDeriveBNTensorDescriptor': (('derivedBnDesc', _ptr), ('xDesc', _ptr), ('mode', _int)),
    'cudnnCreatePoolingDescriptor': _create('pooling'),
    'cudnnDestroyPoolingDescriptor': _create('pooling'),
    'cudnnSetPooling2dDescriptor': (
        ('poolingDesc', _ptr), ('mode', _int), ('maxpoolingNanOpt', _int), ('windowHeight', _int),
        ('windowWidth', _int), ('verticalPadding', _int), ('horizontalPadding', _int),
        ('verticalStride', _int), ('horizontalStride', _int)),
    # convolution algorithms and their workspaces (set-up, outside capture)
    'cudnnGetConvolutionForwardAlgorithm_v7': _get_algorithm('srcDesc', 'filterDesc',
                                                             'destDesc'),
    'cudnnGetConvolutionBackwardDataAlgorithm_v7': _get_algorithm('filterDesc', 'diffDesc',
                                                                  'gradDesc'),
    'cudnnGetConvolutionBackwardFilterAlgorithm_v7': _get_algorithm('srcDesc', 'diffDesc',
                                                                    'gradDesc'),
    'cudnnFindConvolutionForwardAlgorithmEx': _find_algorithm('xDesc', 'x', 'wDesc', 'w',
                                                              'yDesc', 'y'),
    'cudnnFindConvolutionBackwardDataAlgorithmEx': _find_algorithm('wDesc', 'w', 'dyDesc', 'dy',
                                                                   'dxDesc', 'dx'),
    'cudnnFindConvolutionBackwardFilterAlgorithmEx': _find_algorithm('xDesc', 'x', 'dyDesc', 'y',
                                                                     'dwDesc', 'dw'),
    'cudnnGetConvolutionForwardWorkspaceSize': _workspace_size('xDesc', 'wDesc', 'yDesc'),
    'cudnnGetConvolutionBackwardDataWorkspaceSize': _workspace_size('wDesc', 'dyDesc', 'dxDesc'),
    'cudnnGetConvolutionBackwardFilterWorkspaceSize': _workspace_size('xDesc', 'dyDesc',
                                                                      'gradDesc'),
    # the fused batch normalization's buffers (set-up, outside capture)
    'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('xDesc', _ptr), ('zDesc', _ptr),
        ('yDesc', _ptr), ('bnScaleBiasMeanVarDesc', _ptr), ('activationDesc', _ptr),
        ('sizeInBytes', _ptr)),
    'cudnnGetBatchNormalizationBackwardExWorkspaceSize': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('xDesc', _ptr), ('yDesc', _ptr),
        ('dyDesc', _ptr), ('dzDesc', _ptr), ('dxDesc', _ptr), ('dBnScaleBiasDesc', _ptr),
        ('activationDesc', _ptr), ('sizeInBytes', _ptr)),
    'cudnnGetBatchNormalizationTrainingExReserveSpaceSize': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('activationDesc', _ptr),
        ('xDesc', _ptr), ('sizeInBytes', _ptr)),
    # the calls a step makes (also while a stream captures)
    'cudnnConvolutionForward': _conv('xDesc', 'x', 'wDesc', 'w', 'yDesc', 'y'),
    'cudnnConvolutionBackwardData': _conv('wDesc', 'w', 'dyDesc', 'dy', 'dxDesc', 'dx'),
    'cudnnConvolutionBackwardFilter': _conv('xDesc', 'x', 'dyDesc', 'dy', 'dwDesc', 'dw'),
    'cudnnBatchNormalizationForwardTrainingEx': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('alpha', _ptr), ('beta', _ptr),
        ('xDesc', _ptr), ('xData', _ptr), ('zDesc', _ptr), ('zData', _ptr), ('yDesc', _ptr),
        ('yData', _ptr), ('bnScaleBiasMeanVarDesc', _ptr), ('bnScale', _ptr), ('bnBias', _ptr),
        ('exponentialAverageFactor', _double), ('resultRunningMean', _ptr),
        ('resultRunningVariance', _ptr), ('epsilon', _double), ('resultSaveMean', _ptr),
        ('resultSaveInvVariance', _ptr), ('activationDesc', _ptr), ('workspace', _ptr),
        ('workSpaceSizeInBytes', _size), ('reserveSpace', _ptr),
        ('reserveSpaceSizeInBytes', _size)),
    'cudnnBatchNormalizationBackwardEx': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('alphaDataDiff', _ptr),
        ('betaDataDiff', _ptr), ('alphaParamDiff', _ptr), ('betaParamDiff', _ptr),
        ('xDesc', _ptr), ('xData', _ptr), ('yDesc', _ptr), ('yData', _ptr), ('dyDesc', _ptr),
        ('dyData', _ptr), ('dzDesc', _ptr), ('dzData', _ptr), ('dxDesc', _ptr),
        ('dxData', _ptr), ('dBnScaleBiasDesc', _ptr), ('bnScaleData', _ptr),
        ('bnBiasData', _ptr), ('dBnScaleData', _ptr), ('dBnBiasData', _ptr),
        ('epsilon', _double), ('savedMean', _ptr), ('savedInvVariance', _ptr),
        ('activationDesc', _ptr), ('workSpace', _ptr), ('workSpaceSizeInBytes', _size),
        ('reserveSpace', _ptr), ('reserveSpaceSizeInBytes', _size)),
    # Chainer's own fixed batch normalization, softmax, activations and pooling (routed through
    # this binding inside a TrainStep)
    'cudnnBatchNormalizationForwardInference': (
        ('handle', _ptr), ('mode', _int), ('alpha', _ptr), ('beta', _ptr), ('xDesc', _ptr),
        ('x', _ptr), ('yDesc', _ptr), ('y', _ptr), ('bnScaleBiasMeanVarDesc', _ptr),
        ('bnScale', _ptr), ('bnBias', _ptr), ('estimatedMean', _ptr),
        ('estimatedVariance', _ptr), ('epsilon', _double)),
    'cudnnSoftmaxForward': (('handle', _ptr), ('algo', _int), ('mode', _int), ('alpha', _ptr),
                            ('xDesc', _ptr), ('x', _ptr), ('beta', _ptr), ('yDesc', _ptr),
                            ('y', _ptr)),
    'cudnnSoftmaxBackward': (('handle', _ptr), ('algo', _int), ('mode', _int), ('alpha', _ptr),
                             ('yDesc', _ptr), ('y', _ptr), ('dyDesc', _ptr), ('dy', _ptr),
                             ('beta', _ptr), ('dxDesc', _ptr), ('dx', _ptr)),
    'cudnnActivationForward': (('handle', _ptr), ('activationDesc', _ptr), ('alpha', _ptr),
                               ('xDesc', _ptr), ('x', _ptr), ('beta', _ptr), ('yDesc', _ptr),
                               ('y', _ptr)),
    'cudnnActivationBackward': (('handle', _ptr), ('activationDesc', _ptr), ('alpha', _ptr),
                                ('yDesc', _ptr), ('y', _ptr), ('dyDesc', _ptr), ('dy', _ptr),
                                ('xDesc', _ptr), ('x', _ptr), ('beta', _ptr), ('dxDesc', _ptr),
                                ('dx', _ptr)),
    'cudnnPoolingForward': (('handle', _ptr), ('poolingDesc', _ptr), ('alpha', _ptr),
                            ('xDesc', _ptr), ('x', _ptr), ('beta', _ptr), ('yDesc', _ptr),
                            ('y', _ptr)),
    'cudnnPoolingBackward': (('handle', _ptr), ('poolingDesc', _ptr), ('alpha', _ptr),
                             ('yDesc', _ptr), ('y', _ptr), ('dyDesc', _ptr), ('dy', _ptr),
                             ('xDesc', _ptr), ('x', _ptr), ('beta', _ptr), ('dxDesc', _ptr),
                             ('dx', _ptr)),
}
# not returning a status: const char *cudnnGetErrorString(cudnnStatus_t), size_t cudnnGetVersion()
ERROR_STRING = 'cudnnGetErrorString'
GET_VERSION = 'cudnnGetVersion'

# What a training step calls per layer (also while a stream captures); the rest is set-up.
PER_CALL = frozenset(('cudnnSetStream', 'cudnnConvolutionForward', 'cudnnConvolutionBackwardData',
                      'cudnnConvolutionBackwardFilter', 'cudnnBatchNormalizationForwardTrainingEx',
                      'cudnnBatchNormalizationBackwardEx',
                      'cudnnBatchNormalizationForwardInference', 'cudnnSoftmaxForward',
                      'cudnnSoftmaxBackward', 'cudnnActivationForward',
                      'cudnnActivationBackward', 'cudnnPoolingForward', 'cudnnPoolingBackward'))

# The calls that need no GPU: descriptors are host objects (tests make real ones without a GPU).
HOST_ONLY = frozenset(n for n in PROTOTYPES if 'Descriptor' in n or n.startswith(
    'cudnnSetConvolution')) | {ERROR_STRING, GET_VERSION}
